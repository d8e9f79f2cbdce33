// Times E2B's JavaScript SDK and, from the same Node process with plain fetch,
// torpor's own REST API against a torpor server, and prints, as one JSON
// object, every run's milliseconds by client and operation:
// {"sdk": {"<op>": [ms, ...]}, "rest": {"<op>": [ms, ...]}}.
// Arguments: the SDK's dist/index.mjs, a sandbox id (template base, made by
// the Go side, which times torpor's API from Go on it too), the runs for fast
// operations and for slow ones (create, pause, connect). Environment:
// E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY (also the Bearer key of torpor's
// API at TORPOR_API_URL). Run by e2e/e2b_bench_test.go.
import { pathToFileURL } from "node:url";

const [moduleFile, id, fastArg, slowArg] = process.argv.slice(2);
const { Sandbox } = await import(pathToFileURL(moduleFile).href);
const fast = Number(fastArg);
const slow = Number(slowArg);
const out = { sdk: {}, rest: {} };

// time appends to into[op] the milliseconds of each of n runs of fn.
async function time(into, op, n, fn) {
  into[op] ??= [];
  for (let i = 0; i < n; i++) {
    const t0 = performance.now();
    await fn(i);
    into[op].push(performance.now() - t0);
  }
}

const mib = new Uint8Array(1 << 20).map((_, i) => i & 0xff);

// E2B's SDK.
let sbx = await Sandbox.connect(id);
const sdk = {
  create: async (created) => {
    const s = await Sandbox.create("base");
    await s.commands.run("true");
    created.push(s.sandboxId);
  },
  kill: (sid) => Sandbox.kill(sid),
  run: () => sbx.commands.run("true"),
  write: () => sbx.files.write("/tmp/bench.bin", mib.buffer),
  read: async () => {
    const b = await sbx.files.read("/tmp/bench.bin", { format: "bytes" });
    if (b.length !== mib.length) throw new Error(`read ${b.length} bytes`);
  },
  pause: () => sbx.pause(),
  connect: async () => {
    sbx = await Sandbox.connect(id);
    await sbx.commands.run("true");
  },
};

// torpor's REST API (docs/api.md) from the same process, with Node's fetch.
const base = process.env.TORPOR_API_URL;
const auth = { Authorization: `Bearer ${process.env.E2B_API_KEY}` };
async function call(method, path, body, headers = {}) {
  const res = await fetch(base + path, { method, body, headers: { ...auth, ...headers } });
  if (!res.ok) throw new Error(`${method} ${path}: ${res.status} ${await res.text()}`);
  return res;
}
const json = (method, path, v) => call(method, path, JSON.stringify(v), { "Content-Type": "application/json" });
// exec runs cmd in sandbox sid, reads its NDJSON stream to the end and fails
// unless the last line is exit code 0.
async function exec(sid, ...cmd) {
  const text = await (await json("POST", `/v1/sandboxes/${sid}/exec`, { cmd })).text();
  const lines = text.trimEnd().split("\n");
  if (JSON.parse(lines[lines.length - 1]).exit_code !== 0) throw new Error(`exec ${cmd}: ${text}`);
}
const file = `/v1/sandboxes/${id}/files?path=/tmp/bench.bin`;
const rest = {
  create: async (created) => {
    const sb = await (await json("POST", "/v1/sandboxes", { image: "e2b-base" })).json();
    await exec(sb.id, "true");
    created.push(sb.id);
  },
  kill: (sid) => call("DELETE", `/v1/sandboxes/${sid}`),
  run: () => exec(id, "true"),
  bash: () => exec(id, "bash", "-l", "-c", "true"),
  write: async () => {
    await (await call("PUT", file, mib, { "Content-Type": "application/octet-stream" })).arrayBuffer();
  },
  read: async () => {
    const b = await (await call("GET", file)).arrayBuffer();
    if (b.byteLength !== mib.length) throw new Error(`read ${b.byteLength} bytes`);
  },
  pause: async () => (await json("POST", `/v1/sandboxes/${id}/hibernate`, {})).arrayBuffer(),
  connect: async () => {
    await (await json("POST", `/v1/sandboxes/${id}/resume`, {})).arrayBuffer();
    await exec(id, "true");
  },
};

// The two clients alternate run by run, so that both see the same load.
await sdk.run(); // warm: the first calls also open each client's HTTP connections
await rest.run();
async function both(op, n, sdkFn, restFn) {
  for (let i = 0; i < n; i++) {
    await time(out.sdk, op, 1, sdkFn);
    await time(out.rest, op, 1, restFn);
  }
}
const created = { sdk: [], rest: [] };
await both("create → first command", slow, () => sdk.create(created.sdk), () => rest.create(created.rest));
for (const sid of created.sdk) await sdk.kill(sid);
for (const sid of created.rest) await rest.kill(sid);
// The SDK's run is a login bash: torpor's exec of the same command alternates
// with it too.
for (let i = 0; i < fast; i++) {
  await time(out.sdk, "run true", 1, sdk.run);
  await time(out.rest, "run true", 1, rest.run);
  await time(out.rest, "run bash -l -c true", 1, rest.bash);
}
await both("write 1 MiB", fast, sdk.write, rest.write);
await both("read 1 MiB", fast, sdk.read, rest.read);
for (let i = 0; i < slow; i++) {
  await time(out.sdk, "pause", 1, sdk.pause);
  await time(out.sdk, "connect → first command", 1, sdk.connect);
  await time(out.rest, "pause", 1, rest.pause);
  await time(out.rest, "connect → first command", 1, rest.connect);
}
console.log(JSON.stringify(out));
