"""Native reverse-mode differentiation engine."""
