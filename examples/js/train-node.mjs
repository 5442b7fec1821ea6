// Train onnxgrad's artifacts with onnxruntime-node and print the losses as JSON.
//
//   node train-node.mjs ARTIFACTS [--data FILE.json] [--epochs N] [--batch-size B]
//                       [--lr X] [--out FOLDER]
//
// ARTIFACTS is the folder `onnxgrad artifacts` wrote; the data file (default
// ARTIFACTS/data.json) holds one tensor per data input of the train step. With --out, the
// trained checkpoint is written there as checkpoint.json + checkpoint.bin.
import { existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import ort from 'onnxruntime-node';
import { readTensors, train, writeTensors } from './onnxgrad-train.mjs';

function readTensorFile(path) {
  const manifest = JSON.parse(readFileSync(path, 'utf8'));
  return readTensors(manifest, readFileSync(join(path, '..', manifest.data)));
}

const { values, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    data: { type: 'string' },
    epochs: { type: 'string', default: '3' },
    'batch-size': { type: 'string', default: '16' },
    lr: { type: 'string' },
    out: { type: 'string' },
  },
});
if (positionals.length !== 1) {
  console.error('usage: node train-node.mjs ARTIFACTS [--data FILE.json] [--epochs N] ...');
  process.exit(2);
}
if (values.out && existsSync(join(values.out, 'artifacts.json'))) {
  // an artifact folder's inference model may read its weights from checkpoint.bin
  console.error(`--out ${values.out} holds artifacts: save the trained checkpoint elsewhere`);
  process.exit(2);
}
const folder = positionals[0];
const artifacts = JSON.parse(readFileSync(join(folder, 'artifacts.json'), 'utf8'));
const checkpoint = readTensorFile(join(folder, artifacts.checkpoint));
const data = readTensorFile(values.data ?? join(folder, 'data.json'));
const session = await ort.InferenceSession.create(join(folder, artifacts.training_model), {
  executionProviders: ['cpu'],
  intraOpNumThreads: 1,
  interOpNumThreads: 1,
});
const result = await train(ort, session, artifacts, checkpoint, data, {
  epochs: Number(values.epochs),
  batchSize: Number(values['batch-size']),
  learningRate: values.lr === undefined ? undefined : Number(values.lr),
});
if (values.out) {
  mkdirSync(values.out, { recursive: true });
  const { manifest, bytes } = writeTensors(result.checkpoint, 'checkpoint.bin');
  writeFileSync(join(values.out, 'checkpoint.bin'), bytes);
  writeFileSync(join(values.out, 'checkpoint.json'), JSON.stringify(manifest, null, 1));
}
const { losses, stepMs, medianStepMs } = result;
console.log(JSON.stringify({ runtime: `onnxruntime-node ${ort.env.versions.node}`, losses, stepMs,
  medianStepMs }));
