// Times E2B's JavaScript SDK against a torpor server and prints, as one JSON
// object, every run's milliseconds by operation: {"<op>": [ms, ...]}.
// Arguments: the SDK's dist/index.mjs, a sandbox id (template base, made by
// the Go side, which times torpor's own API on it too), the runs for fast
// operations and for slow ones (create, pause, connect). Environment:
// E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY. Run by e2e/e2b_bench_test.go.
import { pathToFileURL } from "node:url";

const [moduleFile, id, fastArg, slowArg] = process.argv.slice(2);
const { Sandbox } = await import(pathToFileURL(moduleFile).href);
const fast = Number(fastArg);
const slow = Number(slowArg);
const out = {};

async function time(op, n, fn) {
  out[op] = [];
  for (let i = 0; i < n; i++) {
    const t0 = performance.now();
    await fn(i);
    out[op].push(performance.now() - t0);
  }
}

let sbx = await Sandbox.connect(id);
await sbx.commands.run("true"); // warm: the first call also opens the SDK's HTTP connections

await time("create → first command", slow, async () => {
  const s = await Sandbox.create("base");
  await s.commands.run("true");
  out.created = (out.created || []).concat(s.sandboxId);
});
for (const sid of out.created) await Sandbox.kill(sid);
delete out.created;

await time("run true", fast, () => sbx.commands.run("true"));
const mib = new Uint8Array(1 << 20).map((_, i) => i & 0xff);
await time("write 1 MiB", fast, () => sbx.files.write("/tmp/bench.bin", mib.buffer));
await time("read 1 MiB", fast, async () => {
  const b = await sbx.files.read("/tmp/bench.bin", { format: "bytes" });
  if (b.length !== mib.length) throw new Error(`read ${b.length} bytes`);
});

out["pause"] = [];
out["connect → first command"] = [];
for (let i = 0; i < slow; i++) {
  let t0 = performance.now();
  await sbx.pause();
  out["pause"].push(performance.now() - t0);
  t0 = performance.now();
  sbx = await Sandbox.connect(id);
  await sbx.commands.run("true");
  out["connect → first command"].push(performance.now() - t0);
}
console.log(JSON.stringify(out));
