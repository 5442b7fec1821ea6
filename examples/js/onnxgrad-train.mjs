// Training with onnxgrad's artifacts on any onnxruntime JavaScript binding (web or node).
//
// The train step is an ordinary ONNX model: each call takes a batch, the weights, the
// optimizer state and the learning rate, and returns the loss, the new weights and the new
// state, which are fed back at the next call. Nothing here depends on the runtime: the
// caller passes the `ort` module and the bytes of the files.

const TYPED_ARRAYS = {
  float32: Float32Array,
  float64: Float64Array,
  float16: Uint16Array,
  int64: BigInt64Array,
  int32: Int32Array,
  int8: Int8Array,
  uint8: Uint8Array,
  bool: Uint8Array,
};
const ALIGNMENT = 64;

/** Tensors of an onnxgrad tensor file: {name: {type, dims, data, group}}, in file order. */
export function readTensors(manifest, buffer) {
  if (manifest.format !== 'onnxgrad.tensors' || manifest.byte_order !== 'little') {
    throw new Error(`not a little-endian onnxgrad tensor file: ${manifest.format}`);
  }
  const bytes = buffer instanceof ArrayBuffer ? buffer : buffer.buffer.slice(
    buffer.byteOffset, buffer.byteOffset + buffer.byteLength);
  const tensors = {};
  for (const entry of manifest.tensors) {
    const Typed = TYPED_ARRAYS[entry.dtype];
    if (!Typed) throw new Error(`tensor ${entry.name}: unknown dtype ${entry.dtype}`);
    const end = entry.offset + entry.nbytes;
    if (end > bytes.byteLength) throw new Error(`tensor ${entry.name}: data file too short`);
    tensors[entry.name] = {
      type: entry.dtype,
      dims: entry.shape,
      data: new Typed(bytes.slice(entry.offset, end)),
      group: entry.group,
    };
  }
  return tensors;
}

/** The manifest and the bytes of a tensor file holding `tensors` ({name: {type, dims, data,
 * group}}), the format readTensors and Python's onnxgrad.load_checkpoint read. */
export function writeTensors(tensors, dataName) {
  const entries = [];
  let offset = 0;
  for (const [name, t] of Object.entries(tensors)) {
    offset += (ALIGNMENT - (offset % ALIGNMENT)) % ALIGNMENT;
    const nbytes = t.data.byteLength;
    entries.push({ name, group: t.group, dtype: t.type, shape: t.dims, offset, nbytes });
    offset += nbytes;
  }
  const bytes = new Uint8Array(offset);
  entries.forEach((e) => {
    const t = tensors[e.name];
    bytes.set(new Uint8Array(t.data.buffer, t.data.byteOffset, t.data.byteLength), e.offset);
  });
  const manifest = {
    format: 'onnxgrad.tensors', version: 1, byte_order: 'little', data: dataName,
    tensors: entries,
  };
  return { manifest, bytes };
}

function rows(tensor, start, end) {
  const size = tensor.dims.slice(1).reduce((a, b) => a * b, 1);
  const dims = [end - start, ...tensor.dims.slice(1)];
  return { type: tensor.type, dims, data: tensor.data.slice(start * size, end * size) };
}

const median = (values) => {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted.length ? sorted[Math.floor(sorted.length / 2)] : NaN;
};

/**
 * Train for `epochs` passes over `data` ({input name: tensor}, the rows in order, batches
 * of `batchSize`), starting from `checkpoint` (readTensors of checkpoint.json).
 * Returns {losses, stepMs, medianStepMs, checkpoint}: the loss of every step (computed
 * before its update), the time of every step, and the trained checkpoint (same names).
 */
export async function train(ort, session, artifacts, checkpoint, data, options = {}) {
  const spec = artifacts.train;
  const epochs = options.epochs ?? 1;
  const batchSize = options.batchSize ?? 32;
  const lrValue = options.learningRate ?? artifacts.learning_rate.value;
  const toTensor = (t) => new ort.Tensor(t.type, t.data, t.dims);
  const feedBack = [...spec.weights, ...spec.state];
  const state = {};
  for (const { input } of feedBack) {
    if (!checkpoint[input]) throw new Error(`the checkpoint has no tensor ${input}`);
    state[input] = toTensor(checkpoint[input]);
  }
  const dataInputs = [...spec.features, spec.label];
  for (const name of dataInputs) {
    if (!data[name]) throw new Error(`the data has no tensor ${name}`);
  }
  const n = data[spec.label].dims[0];
  const lr = new ort.Tensor(artifacts.learning_rate.dtype,
    artifacts.learning_rate.dtype === 'float64' ? new Float64Array([lrValue])
      : new Float32Array([lrValue]), []);
  const losses = [];
  const stepMs = [];
  for (let epoch = 0; epoch < epochs; epoch += 1) {
    for (let start = 0; start < n; start += batchSize) {
      const end = Math.min(start + batchSize, n);
      const feeds = { ...state, [spec.learning_rate]: lr };
      for (const name of dataInputs) feeds[name] = toTensor(rows(data[name], start, end));
      const t0 = performance.now();
      const out = await session.run(feeds);
      stepMs.push(performance.now() - t0);
      losses.push(Number(out[spec.loss].data[0]));
      for (const { input, output } of feedBack) state[input] = out[output];
      if (options.onStep) options.onStep(losses.length, losses[losses.length - 1]);
    }
  }
  const trained = {};
  for (const { input } of feedBack) {
    const t = state[input];
    trained[input] = { type: t.type, dims: [...t.dims], data: t.data, group: checkpoint[input].group };
  }
  return { losses, stepMs, medianStepMs: median(stepMs), checkpoint: trained };
}
