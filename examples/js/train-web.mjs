// The browser half of the example: fetch the artifacts, train with onnxruntime-web (WASM,
// one thread), show the loss of every step, and publish the result as JSON in
// `window.onnxgradResult` (and on the console) for whoever drives the page.
import * as ort from './node_modules/onnxruntime-web/dist/ort.wasm.min.mjs';
import { readTensors, train, writeTensors } from './onnxgrad-train.mjs';

const params = new URLSearchParams(window.location.search);
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

async function main() {
  ort.env.wasm.numThreads = 1;
  ort.env.wasm.wasmPaths = new URL('./node_modules/onnxruntime-web/dist/', import.meta.url).href;
  const artifacts = await (await fetchOk(new URL('artifacts.json', folder))).json();
  const checkpoint = await readTensorFile(new URL(artifacts.checkpoint, folder));
  const data = await readTensorFile(new URL(params.get('data') ?? 'data.json', folder));
  const model = await (await fetchOk(new URL(artifacts.training_model, folder))).arrayBuffer();
  const session = await ort.InferenceSession.create(new Uint8Array(model), {
    executionProviders: ['wasm'],
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
    runtime: `onnxruntime-web ${ort.env.versions.web} (wasm)`,
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
