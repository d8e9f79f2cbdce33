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
{
  const sdk = out.sdk;
  let sbx = await Sandbox.connect(id);
  await sbx.commands.run("true"); // warm: the first call also opens the SDK's HTTP connections
  const created = [];
  await time(sdk, "create → first command", slow, async () => {
    const s = await Sandbox.create("base");
    await s.commands.run("true");
    created.push(s.sandboxId);
  });
  for (const sid of created) await Sandbox.kill(sid);

  await time(sdk, "run true", fast, () => sbx.commands.run("true"));
  await time(sdk, "write 1 MiB", fast, () => sbx.files.write("/tmp/bench.bin", mib.buffer));
  await time(sdk, "read 1 MiB", fast, async () => {
    const b = await sbx.files.read("/tmp/bench.bin", { format: "bytes" });
    if (b.length !== mib.length) throw new Error(`read ${b.length} bytes`);
  });
  for (let i = 0; i < slow; i++) {
    await time(sdk, "pause", 1, () => sbx.pause());
    await time(sdk, "connect → first command", 1, async () => {
      sbx = await Sandbox.connect(id);
      await sbx.commands.run("true");
    });
  }
}

// torpor's REST API (docs/api.md) from the same process, with Node's fetch.
{
  const rest = out.rest;
  const base = process.env.TORPOR_API_URL;
  const auth = { Authorization: `Bearer ${process.env.E2B_API_KEY}` };
  async function call(method, path, body, headers = {}) {
    const res = await fetch(base + path, { method, body, headers: { ...auth, ...headers } });
    if (!res.ok) throw new Error(`${method} ${path}: ${res.status} ${await res.text()}`);
    return res;
  }
  const json = (method, path, v) =>
    call(method, path, v === undefined ? undefined : JSON.stringify(v), { "Content-Type": "application/json" });
  // exec runs cmd in sandbox sid, reads its NDJSON stream to the end and
  // fails unless the last line is exit code 0.
  async function exec(sid, ...cmd) {
    const text = await (await json("POST", `/v1/sandboxes/${sid}/exec`, { cmd })).text();
    const lines = text.trimEnd().split("\n");
    const last = JSON.parse(lines[lines.length - 1]);
    if (last.exit_code !== 0) throw new Error(`exec ${cmd}: ${text}`);
  }
  const file = `/v1/sandboxes/${id}/files?path=/tmp/bench.bin`;

  await exec(id, "true"); // warm: opens fetch's connection
  const created = [];
  await time(rest, "create → first command", slow, async () => {
    const sb = await (await json("POST", "/v1/sandboxes", { image: "e2b-base" })).json();
    await exec(sb.id, "true");
    created.push(sb.id);
  });
  for (const sid of created) await call("DELETE", `/v1/sandboxes/${sid}`);

  await time(rest, "run true", fast, () => exec(id, "true"));
  await time(rest, "run bash -l -c true", fast, () => exec(id, "bash", "-l", "-c", "true"));
  await time(rest, "write 1 MiB", fast, async () => {
    await (await call("PUT", file, mib, { "Content-Type": "application/octet-stream" })).arrayBuffer();
  });
  await time(rest, "read 1 MiB", fast, async () => {
    const b = await (await call("GET", file)).arrayBuffer();
    if (b.byteLength !== mib.length) throw new Error(`read ${b.byteLength} bytes`);
  });
  for (let i = 0; i < slow; i++) {
    await time(rest, "pause", 1, () => json("POST", `/v1/sandboxes/${id}/hibernate`, {}).then((r) => r.arrayBuffer()));
    await time(rest, "connect → first command", 1, async () => {
      await (await json("POST", `/v1/sandboxes/${id}/resume`, {})).arrayBuffer();
      await exec(id, "true");
    });
  }
}
console.log(JSON.stringify(out));
