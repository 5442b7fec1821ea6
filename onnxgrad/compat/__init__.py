"""Opt-in forms of other libraries' APIs for code written against them.

Nothing in onnxgrad imports these modules: each one keeps another library's defaults and
return forms where they differ from onnxgrad's (see ``docs/migrating-from-onnxcustom.md``).
"""
