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
