// The browser half of the example: fetch the artifacts, train with onnxruntime-web (WASM,
// one thread, or WebGPU with `?ep=webgpu`), show the loss of every step, and publish the
// result as JSON in `window.onnxgradResult` (and on the console) for whoever drives the page.
//
// WebGPU wants `navigator.gpu` (a secure context: https or localhost) and an adapter; where
// either is missing the page trains on WASM and says why in the report's `fallback`.
// `?verbose=1` turns on onnxruntime's verbose log, which names the nodes of the session that
// run on the CPU (fallback-nodes.mjs reads it).
import { readTensors, train, writeTensors } from './onnxgrad-train.mjs';

const params = new URLSearchParams(window.location.search);
const DIST = './node_modules/onnxruntime-web/dist/';
const folder = new URL(params.get('artifacts') ?? 'artifacts/', window.location.href);
const status = document.getElementById('status');
const log = document.getElementById('log');

async function fetchOk(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  return response;
}

async function readTensorFile(url) {
  const manifest = await (await fetchOk(url)).json();
  const bytes = await (await fetchOk(new URL(manifest.data, url))).arrayBuffer();
  return readTensors(manifest, bytes);
}

function toBase64(bytes) {
  let text = '';
  for (let i = 0; i < bytes.length; i += 0x8000) {
    text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  }
  return btoa(text);
}

/** The execution provider to use: 'webgpu' when asked for and an adapter is had, else
 * 'wasm'; `fallback` says why WebGPU was not used. */
async function chooseProvider(wanted) {
  if (wanted !== 'webgpu') return { provider: 'wasm', fallback: null };
  if (!navigator.gpu) return { provider: 'wasm', fallback: 'navigator.gpu is missing' };
  const adapter = await navigator.gpu.requestAdapter();
  if (!adapter) return { provider: 'wasm', fallback: 'navigator.gpu.requestAdapter() gave null' };
  const info = adapter.info ?? {};
  return { provider: 'webgpu', fallback: null, adapter: `${info.vendor} ${info.architecture}` };
}

/** Create a session of every model of the artifacts with the verbose log on (which lists
 * the provider of every node), each announced by a line `onnxgrad-session: FILE`. */
async function logPlacements(ort, choice, artifacts) {
  ort.env.logLevel = 'verbose';
  const files = [artifacts.training_model, artifacts.eval_model, artifacts.inference_model];
  for (const file of files.filter(Boolean)) {
    console.log(`onnxgrad-session: ${file}`);
    const bytes = await (await fetchOk(new URL(file, folder))).arrayBuffer();
    const session = await ort.InferenceSession.create(new Uint8Array(bytes), {
      executionProviders: [choice.provider], logSeverityLevel: 0, logVerbosityLevel: 0,
    });
    await session.release();
  }
  window.onnxgradResult = { provider: choice.provider, adapter: choice.adapter ?? null,
    fallback: choice.fallback, sessions: files };
  status.textContent = 'placements logged';
}

async function main() {
  const choice = await chooseProvider(params.get('ep') ?? 'wasm');
  const bundle = choice.provider === 'webgpu' ? 'ort.webgpu.min.mjs' : 'ort.wasm.min.mjs';
  const ort = await import(`${DIST}${bundle}`);
  const verbose = params.get('verbose') === '1';
  ort.env.wasm.numThreads = 1;
  ort.env.wasm.wasmPaths = new URL(DIST, import.meta.url).href;
  if (verbose) ort.env.logLevel = 'verbose';
  const artifacts = await (await fetchOk(new URL('artifacts.json', folder))).json();
  if (params.get('placements') === '1') {
    await logPlacements(ort, choice, artifacts);
    return;
  }
  const checkpoint = await readTensorFile(new URL(artifacts.checkpoint, folder));
  const data = await readTensorFile(new URL(params.get('data') ?? 'data.json', folder));
  const model = await (await fetchOk(new URL(artifacts.training_model, folder))).arrayBuffer();
  const session = await ort.InferenceSession.create(new Uint8Array(model), {
    executionProviders: [choice.provider],
    ...(verbose ? { logSeverityLevel: 0, logVerbosityLevel: 0 } : {}),
  });
  status.textContent = 'training…';
  const result = await train(ort, session, artifacts, checkpoint, data, {
    epochs: Number(params.get('epochs') ?? 3),
    batchSize: Number(params.get('batch') ?? 16),
    learningRate: params.has('lr') ? Number(params.get('lr')) : undefined,
    onStep: (step, loss) => { log.textContent += `step ${step}  loss ${loss.toPrecision(6)}\n`; },
  });
  const { manifest, bytes } = writeTensors(result.checkpoint, 'checkpoint.bin');
  document.getElementById('manifest').href = URL.createObjectURL(
    new Blob([JSON.stringify(manifest, null, 1)], { type: 'application/json' }));
  document.getElementById('data').href = URL.createObjectURL(new Blob([bytes]));
  document.getElementById('download').hidden = false;
  const report = {
    runtime: `onnxruntime-web ${ort.env.versions.web} (${choice.provider})`,
    provider: choice.provider,
    adapter: choice.adapter ?? null,
    fallback: choice.fallback,
    losses: result.losses,
    stepMs: result.stepMs,
    medianStepMs: result.medianStepMs,
  };
  window.onnxgradCheckpoint = { manifest, base64: toBase64(bytes) };
  status.textContent = `done: ${result.losses.length} steps, median ${result.medianStepMs.toFixed(3)} ms a step`;
  console.log(JSON.stringify(report));
  window.onnxgradResult = report;
}

main().catch((error) => {
  status.textContent = `failed: ${error.message ?? error}`;
  console.error(error);
  window.onnxgradResult = { error: String(error.message ?? error) };
});
