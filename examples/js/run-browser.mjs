// Open the example page in headless Chromium (the system's, never a downloaded one), wait
// for the training to end, print its JSON report; with --out, save the trained checkpoint.
//
//   node run-browser.mjs URL [--out FOLDER] [--chromium /usr/bin/chromium] [--timeout 120]
//                            [--webgpu]
//
// --webgpu starts Chromium with WebGPU on (and, on a machine without a GPU, SwiftShader's
// software Vulkan as its adapter); without it the GPU is off, as the WASM page wants.
import { existsSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { chromium } from 'playwright-core';

const { values, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    out: { type: 'string' },
    chromium: { type: 'string', default: '/usr/bin/chromium' },
    timeout: { type: 'string', default: '120' },
    webgpu: { type: 'boolean', default: false },
  },
});
if (positionals.length !== 1) {
  console.error('usage: node run-browser.mjs URL [--out FOLDER]');
  process.exit(2);
}
if (values.out && existsSync(join(values.out, 'artifacts.json'))) {
  // an artifact folder's inference model may read its weights from checkpoint.bin
  console.error(`--out ${values.out} holds artifacts: save the trained checkpoint elsewhere`);
  process.exit(2);
}
const WEBGPU_FLAGS = [
  '--enable-unsafe-webgpu', '--enable-features=Vulkan', '--use-vulkan=swiftshader',
  '--use-webgpu-adapter=swiftshader', '--use-angle=swiftshader',
];
const profile = mkdtempSync(join(tmpdir(), 'onnxgrad-chromium-'));
const context = await chromium.launchPersistentContext(profile, {
  executablePath: values.chromium,
  headless: true,
  args: [
    '--headless=new', '--no-sandbox', '--disable-quic', '--no-first-run',
    '--disable-background-networking', '--disable-component-update', '--disable-sync',
    ...(values.webgpu ? WEBGPU_FLAGS : ['--disable-gpu']),
  ],
});
const messages = [];
try {
  const page = context.pages()[0] ?? await context.newPage();
  page.on('console', (m) => messages.push(`${m.type()}: ${m.text()}`));
  page.on('pageerror', (e) => messages.push(`pageerror: ${e.message}`));
  await page.goto(positionals[0]);
  await page.waitForFunction(() => window.onnxgradResult !== undefined, null,
    { timeout: Number(values.timeout) * 1000 });
  const result = await page.evaluate(() => window.onnxgradResult);
  if (values.out && !result.error) {
    const { manifest, base64 } = await page.evaluate(() => window.onnxgradCheckpoint);
    mkdirSync(values.out, { recursive: true });
    writeFileSync(join(values.out, 'checkpoint.bin'), Buffer.from(base64, 'base64'));
    writeFileSync(join(values.out, 'checkpoint.json'), JSON.stringify(manifest, null, 1));
  }
  result.browser = context.browser()?.version() ?? 'chromium';
  result.console = messages;
  console.log(JSON.stringify(result));
  if (result.error) process.exitCode = 1;
} catch (error) {
  console.log(JSON.stringify({ error: String(error.message ?? error), console: messages }));
  process.exitCode = 1;
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
