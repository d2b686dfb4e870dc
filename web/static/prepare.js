// LiteRT.js can return from loadAndCompile, and from a run, for a model XNNPACK (its wasm CPU path) failed
// to prepare, e.g. when the model does not fit its 2 GB wasm heap: only its console output says so, and
// the run's outputs are not computed. LiteRT.js binds console.error when it loads, so the page taps
// console.error before that (app.js: installConsoleTap) and each component checks the lines printed
// while it compiled and first ran.

const PREPARE_FAILED = /failed to prepare|Failed to allocate tensors|failed to create XNNPACK runtime/;
const KEEP = 200; // lines kept; a check reads only those since its mark

const tap = { lines: [], count: 0, installed: false };

/** Route console.error through a recorder (once; what was printed still reaches the console). */
export function installConsoleTap() {
  if (tap.installed) return;
  const original = console.error.bind(console);
  console.error = (...args) => {
    tap.lines.push(args.map(String).join(' '));
    if (tap.lines.length > KEEP) tap.lines.shift();
    tap.count += 1;
    original(...args);
  };
  tap.installed = true;
}

/** A position in the recorded lines: consoleSince(mark) gives what was printed after it. */
export function consoleMark() {
  return tap.count;
}

export function consoleSince(mark) {
  const n = Math.min(tap.count - mark, tap.lines.length);
  return n > 0 ? tap.lines.slice(tap.lines.length - n) : [];
}

/** The first line that says a model could not be prepared, or null. */
export function prepareFailure(lines) {
  return lines.find((line) => PREPARE_FAILED.test(line)) ?? null;
}

/** At half precision a GPU can return NaN or Inf where fp32 does not (SwiftShader's text encoder, LiteRT.js 2.5.3):
 *  the line that stops the run, naming the model and the precision, or null when `data` is finite or the
 *  model ran at fp32 (a non-finite fp32 result is the image check's to report). */
export function halfPrecisionProblem(what, data, precision) {
  if (precision !== 'fp16') return null;
  for (let i = 0; i < data.length; i++) {
    if (!Number.isFinite(data[i])) return `${what}: NaN/Inf values at fp16 on this GPU (value ${i} of ${data.length}); run it at fp32`;
  }
  return null;
}
