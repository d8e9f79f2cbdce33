// Drives E2B's published JavaScript SDK against a torpor server and prints, as
// one JSON object, the result of every check: {"checks": [{name, ok, error?}]}.
// Arguments: the SDK's dist/index.mjs (e2e/e2bsdk/node_modules/<package>/...).
// Environment: E2B_API_URL and E2B_SANDBOX_URL (the server), E2B_API_KEY,
// TORPOR_WORKLOAD (a sandbox running workload/server.py on port 8080, made by
// the Go test through torpor's API), TORPOR_TAG (unique per run, for metadata
// filters). Run by e2e/e2b_sdk_test.go.
import { pathToFileURL } from "node:url";
import http from "node:http";

const sdk = await import(pathToFileURL(process.argv[2]).href);
const { Sandbox } = sdk;
const api = new URL(process.env.E2B_API_URL);
const tag = process.env.TORPOR_TAG;
const workload = process.env.TORPOR_WORKLOAD;
const checks = [];

async function check(name, fn) {
  try {
    await fn();
    checks.push({ name, ok: true });
  } catch (e) {
    checks.push({ name, ok: false, error: String((e && e.stack) || e) });
  }
}

function assert(cond, msg) {
  if (!cond) throw new Error(msg);
}

async function errName(fn) {
  try {
    await fn();
    return "no error";
  } catch (e) {
    return e.constructor.name;
  }
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// get sends GET path to the server at the torpor URL with a Host header (what
// a client reaching sandbox.getHost(port) through wildcard DNS sends).
function get(host, path) {
  return new Promise((resolve, reject) => {
    const req = http.request({ host: api.hostname, port: api.port, path, headers: { Host: host } }, (res) => {
      let body = "";
      res.on("data", (c) => (body += c));
      res.on("end", () => resolve({ status: res.statusCode, body }));
    });
    req.on("error", reject);
    req.end();
  });
}

async function count(sbx) {
  const r = await get(sbx.getHost(8080), "/count");
  assert(r.status === 200, `GET /count via ${sbx.getHost(8080)}: ${r.status} ${r.body}`);
  return JSON.parse(r.body);
}

async function waitFor(what, fn, ms = 60_000) {
  const end = Date.now() + ms;
  for (;;) {
    if (await fn()) return;
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await sleep(200);
  }
}

let sbx;
await check("create with metadata and envs; getInfo", async () => {
  sbx = await Sandbox.create("base", { metadata: { suite: tag, n: "1" }, envs: { A: "1" }, timeoutMs: 120_000 });
  const info = await sbx.getInfo();
  assert(info.sandboxId === sbx.sandboxId, `info id ${info.sandboxId}`);
  assert(info.templateId === "base", `templateId ${info.templateId}`);
  assert(info.state === "running", `state ${info.state}`);
  assert(info.metadata.suite === tag && info.metadata.n === "1", `metadata ${JSON.stringify(info.metadata)}`);
  assert(info.cpuCount >= 1 && info.memoryMB === 512, `cpu ${info.cpuCount} memory ${info.memoryMB}`);
  const left = info.endAt.getTime() - Date.now();
  assert(left > 100_000 && left <= 121_000, `endAt ${left} ms away, want about 120 s`);
});

await check("wrong API key: AuthenticationError", async () => {
  const bad = { apiKey: "e2b_ffffffff" };
  const create = await errName(() => Sandbox.create("base", bad));
  assert(create === "AuthenticationError", `create threw ${create}`);
  const info = await errName(() => Sandbox.getInfo(sbx.sandboxId, bad));
  assert(info === "AuthenticationError", `getInfo threw ${info}`);
});

await check("getInfo of an unknown sandbox: NotFound", async () => {
  const e = await errName(() => Sandbox.getInfo("sbx-000000000000"));
  assert(e.includes("NotFound"), `threw ${e}`);
});

await check("list with a metadata filter, three pages", async () => {
  const more = [await Sandbox.create("base", { metadata: { suite: tag, n: "2" } }), await Sandbox.create("base", { metadata: { suite: tag, n: "3" } })];
  const pages = Sandbox.list({ query: { metadata: { suite: tag }, state: ["running"] }, limit: 1 });
  const seen = [];
  let n = 0;
  while (pages.hasNext) {
    const items = await pages.nextItems();
    if (items.length) n++;
    seen.push(...items.map((s) => s.sandboxId));
    assert(n <= 4, "too many pages");
  }
  const want = [sbx.sandboxId, ...more.map((s) => s.sandboxId)];
  assert(n === 3 && seen.length === 3 && want.every((id) => seen.includes(id)), `pages ${n}: ${seen}, want ${want}`);
  for (const s of more) await s.kill();
});

await check("setTimeout", async () => {
  await sbx.setTimeout(60_000);
  const left = (await sbx.getInfo()).endAt.getTime() - Date.now();
  assert(left > 50_000 && left <= 61_000, `endAt ${left} ms away, want about 60 s`);
});

let w;
let first;
await check("connect; getHost(port) reached with a Host header", async () => {
  w = await Sandbox.connect(workload);
  assert(w.getHost(8080) === `8080-${workload}.${process.env.TORPOR_DOMAIN}`, `getHost ${w.getHost(8080)}`);
  first = await count(w);
  assert(first.pid > 0, `answer ${JSON.stringify(first)}`);
});

await check("pause twice (second false); connect with memory intact", async () => {
  assert((await Sandbox.pause(workload)) === true, "first pause did not return true");
  assert((await Sandbox.pause(workload)) === false, "second pause did not return false");
  assert((await Sandbox.getInfo(workload)).state === "paused", "not paused");
  w = await Sandbox.connect(workload);
  assert((await Sandbox.getInfo(workload)).state === "running", "not running after connect");
  const st = await count(w);
  assert(st.pid === first.pid && st.count === first.count + 1, `after the pause ${JSON.stringify(st)}, before ${JSON.stringify(first)}`);
  first = st;
});

await check("createSnapshot; create from it; each its own later writes; deleteSnapshot twice", async () => {
  const snap = await Sandbox.createSnapshot(workload);
  assert(snap.snapshotId.startsWith("snap-"), `snapshot ${JSON.stringify(snap)}`);
  const clone = await Sandbox.create(snap.snapshotId);
  const c1 = await count(clone);
  assert(c1.pid === first.pid && c1.count === first.count + 1, `clone answers ${JSON.stringify(c1)}, source was ${JSON.stringify(first)}`);
  const c2 = await count(clone);
  const s1 = await count(w);
  assert(c2.count === first.count + 2 && s1.count === first.count + 1, `clone ${c2.count}, source ${s1.count}`);
  first = s1;
  await clone.kill();
  assert((await Sandbox.deleteSnapshot(snap.snapshotId)) === true, "deleteSnapshot did not return true");
  assert((await Sandbox.deleteSnapshot(snap.snapshotId)) === false, "second deleteSnapshot did not return false");
});

await check("fork count 2", async () => {
  const forks = await Sandbox.fork(workload, { count: 2 });
  assert(forks.length === 2 && forks.every((f) => !(f instanceof Error)), `forks ${forks}`);
  for (const f of forks) {
    assert(f.sandboxId !== workload, "fork has the source's id");
    const st = await count(f);
    assert(st.pid === first.pid && st.count === first.count + 1, `fork answers ${JSON.stringify(st)}`);
    await f.kill();
  }
});

await check("getMetrics", async () => {
  const ms = await Sandbox.getMetrics(workload);
  assert(ms.length === 1 && ms[0].memUsed > 0 && ms[0].memTotal === 512 * 1024 * 1024 && ms[0].cpuCount >= 1, `metrics ${JSON.stringify(ms)}`);
});

await check("kill twice (second false)", async () => {
  assert((await sbx.kill()) === true, "kill did not return true");
  assert((await Sandbox.kill(sbx.sandboxId)) === false, "second kill did not return false");
});

await check("timeout fires: killed", async () => {
  const s = await Sandbox.create("base", { timeoutMs: 2_000 });
  await waitFor("the timeout to kill it", async () => (await errName(() => Sandbox.getInfo(s.sandboxId))).includes("NotFound"));
});

await check("timeout with onTimeout pause: paused; with autoResume a request wakes it", async () => {
  const s = await Sandbox.create("base", { timeoutMs: 2_000, lifecycle: { onTimeout: "pause", autoResume: true } });
  await waitFor("the timeout to pause it", async () => (await Sandbox.getInfo(s.sandboxId)).state === "paused");
  // Nothing listens on the port: the request wakes the sandbox and is refused (502).
  const r = await get(s.getHost(8080), "/");
  assert(r.status === 502, `request to the paused sandbox: ${r.status} ${r.body}`);
  const info = await Sandbox.getInfo(s.sandboxId);
  assert(info.state === "running", `after the request: ${info.state}`);
  await s.kill();
});

console.log(JSON.stringify({ checks }));
