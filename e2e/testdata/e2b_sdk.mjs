// Drives E2B's published JavaScript SDK against a torpor server and prints, as
// one JSON object, the result of every check: {"checks": [{name, ok, error?}]}.
// Arguments: the SDK's dist/index.mjs (e2e/e2bsdk/node_modules/<package>/...).
// Environment: E2B_API_URL and E2B_SANDBOX_URL (the server), E2B_API_KEY,
// TORPOR_WORKLOAD (a sandbox running workload/server.py on port 8080, made by
// the Go test through E2B's API and started through torpor's), TORPOR_TAG (unique per run, for metadata
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
// a client reaching sandbox.getHost(port) through wildcard DNS sends) and the
// headers in extra.
function get(host, path, extra = {}) {
  return new Promise((resolve, reject) => {
    const req = http.request({ host: api.hostname, port: api.port, path, headers: { ...extra, Host: host } }, (res) => {
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

// envd: commands, PTY and files on sbx (template base: user "user", /home/user).
const enc = new TextEncoder();
const dec = new TextDecoder();

await check("commands.run: output, exit code, default user user, user root, cwd, envs", async () => {
  const r = await sbx.commands.run('echo out; echo err >&2; whoami; pwd; echo "$A $B"', { envs: { B: "2" } });
  assert(r.exitCode === 0 && r.stdout === "out\nuser\n/home/user\n1 2\n" && r.stderr === "err\n", `run ${JSON.stringify(r)}`);
  const root = await sbx.commands.run("whoami; pwd", { user: "root", cwd: "/tmp" });
  assert(root.stdout === "root\n/tmp\n", `as root in /tmp: ${JSON.stringify(root.stdout)}`);
});

await check("commands.run: a failing command throws CommandExitError", async () => {
  try {
    await sbx.commands.run("echo partial; exit 7");
    throw new Error("no error");
  } catch (e) {
    assert(e instanceof sdk.CommandExitError && e.exitCode === 7 && e.stdout === "partial\n", `threw ${e.constructor.name} ${e.exitCode} ${JSON.stringify(e.stdout)}`);
  }
});

await check("commands.run: timeoutMs ends a long command", async () => {
  const t0 = Date.now();
  const e = await errName(() => sbx.commands.run("sleep 30", { timeoutMs: 1_000 }));
  const took = Date.now() - t0;
  assert(e === "TimeoutError" && took < 10_000, `threw ${e} after ${took} ms`);
  // The SDK gives up on its side and closes the stream; envd kills the process
  // once it sees the stream closed, which a loaded host may take a moment to do.
  let left;
  for (let i = 0; i < 50; i++) {
    left = await sbx.commands.run("pgrep -x sleep || true");
    if (left.stdout === "") break;
    await new Promise((r) => setTimeout(r, 100));
  }
  assert(left.stdout === "", `sleep still runs 5 s after the timeout: ${JSON.stringify(left.stdout)}`);
});

await check("background command: stdin via sendStdin, list, connect by pid, kill", async () => {
  const cat = await sbx.commands.run("cat", { background: true, stdin: true });
  const procs = await sbx.commands.list();
  assert(procs.some((p) => p.pid === cat.pid), `list ${JSON.stringify(procs.map((p) => p.pid))} lacks ${cat.pid}`);
  let seen = "";
  const again = await sbx.commands.connect(cat.pid, { onStdout: (d) => (seen += d) });
  await sbx.commands.sendStdin(cat.pid, "piped\n");
  await waitFor("the piped line on the connected handle", async () => seen.includes("piped\n"), 10_000);
  assert((await sbx.commands.kill(cat.pid)) === true, "kill did not return true");
  const end = await errName(() => again.wait());
  assert(end === "CommandExitError", `wait after kill threw ${end}`);
  assert((await sbx.commands.kill(cat.pid)) === false, "second kill did not return false");
  assert(!(await sbx.commands.list()).some((p) => p.pid === cat.pid), "killed process still listed");
});

await check("pty: create, sendInput, resize, output seen", async () => {
  let out = "";
  const term = await sbx.pty.create({ cols: 90, rows: 20, onData: (d) => (out += dec.decode(d)) });
  await sbx.pty.sendInput(term.pid, enc.encode("stty size\n"));
  await waitFor("stty size 20 90", async () => out.includes("20 90"), 10_000);
  await sbx.pty.resize(term.pid, { cols: 100, rows: 30 });
  await sbx.pty.sendInput(term.pid, enc.encode("stty size; whoami; exit\n"));
  await term.wait().catch(() => {});
  assert(out.includes("30 100") && out.includes("user"), `pty output ${JSON.stringify(out)}`);
});

await check("files: write/read text, bytes, a stream; getInfo; exists", async () => {
  const w = await sbx.files.write("notes/a.txt", "hello files");
  assert(w.path === "/home/user/notes/a.txt" && w.name === "a.txt", `write ${JSON.stringify(w)}`);
  assert((await sbx.files.read("/home/user/notes/a.txt")) === "hello files", "text read back differs");
  const bytes = new Uint8Array(256).map((_, i) => i);
  await sbx.files.write("notes/b.bin", bytes.buffer);
  const got = await sbx.files.read("notes/b.bin", { format: "bytes" });
  assert(got.length === 256 && got.every((v, i) => v === i), `bytes read back: ${got.length}`);
  const big = "x".repeat(300_000);
  const stream = new ReadableStream({ start(c) { c.enqueue(enc.encode(big.slice(0, 100_000))); c.enqueue(enc.encode(big.slice(100_000))); c.close(); } });
  await sbx.files.write("notes/c.txt", stream);
  const rs = await sbx.files.read("notes/c.txt", { format: "stream" });
  let n = 0;
  for await (const chunk of rs) n += chunk.length;
  assert(n === big.length, `streamed ${n} bytes back, want ${big.length}`);
  const info = await sbx.files.getInfo("notes/a.txt");
  assert(info.name === "a.txt" && info.type === "file" && info.size === 11 && info.owner === "user", `getInfo ${JSON.stringify(info)}`);
  assert((await sbx.files.exists("notes/a.txt")) === true && (await sbx.files.exists("notes/none")) === false, "exists");
  const missing = await errName(() => sbx.files.read("notes/none"));
  assert(missing === "FileNotFoundError" || missing === "NotFoundError", `read of a missing file threw ${missing}`);
});

await check("files: metadata on write (multipart and gzip octet-stream), getInfo, list; a rewrite replaces it", async () => {
  const sorted = (m) => JSON.stringify(Object.entries(m || {}).sort());
  const want = sorted({ author: "torpor", purpose: "sdk test" });
  const w = await sbx.files.write("meta/m.txt", "m", { metadata: { Author: "torpor", purpose: "sdk test" } });
  assert(sorted(w.metadata) === want, `write answered metadata ${JSON.stringify(w.metadata)}`);
  const g = await sbx.files.write("meta/g.txt", "g".repeat(1000), { metadata: { k: "v" }, gzip: true });
  assert(sorted(g.metadata) === sorted({ k: "v" }) && (await sbx.files.read("meta/g.txt")).length === 1000, `gzip write ${JSON.stringify(g)}`);
  const info = await sbx.files.getInfo("meta/m.txt");
  assert(sorted(info.metadata) === want, `getInfo metadata ${JSON.stringify(info.metadata)}`);
  const listed = (await sbx.files.list("meta")).find((e) => e.name === "m.txt");
  assert(listed && sorted(listed.metadata) === want, `list metadata ${JSON.stringify(listed)}`);
  const again = await sbx.files.write("meta/m.txt", "m2", { metadata: { author: "other" } });
  assert(sorted(again.metadata) === sorted({ author: "other" }), `rewrite metadata ${JSON.stringify(again.metadata)}`);
  await sbx.files.write("meta/m.txt", "m3");
  assert((await sbx.files.getInfo("meta/m.txt")).metadata === undefined, "a write without metadata left some");
  const bad = await errName(() => sbx.files.write("meta/bad.txt", "x", { metadata: { "bad key": "v" } }));
  assert(bad === "InvalidArgumentError", `a key with a space threw ${bad}`);
});

await check("files: makeDir, list with depth, rename, remove", async () => {
  assert((await sbx.files.makeDir("tree/sub/deeper")) === true, "makeDir did not return true");
  assert((await sbx.files.makeDir("tree/sub/deeper")) === false, "second makeDir did not return false");
  await sbx.files.write("tree/sub/f.txt", "f");
  const one = (await sbx.files.list("tree")).map((e) => e.name);
  assert(one.length === 1 && one[0] === "sub", `list depth 1: ${one}`);
  const two = (await sbx.files.list("tree", { depth: 3 })).map((e) => e.path.slice("/home/user/tree/".length) + ":" + e.type).sort();
  assert(JSON.stringify(two) === JSON.stringify(["sub/deeper:dir", "sub/f.txt:file", "sub:dir"]), `list depth 3: ${two}`);
  const moved = await sbx.files.rename("tree/sub/f.txt", "tree/g.txt");
  assert(moved.path === "/home/user/tree/g.txt" && (await sbx.files.read("tree/g.txt")) === "f", `rename ${JSON.stringify(moved)}`);
  await sbx.files.remove("tree/sub");
  assert(!(await sbx.files.exists("tree/sub")) && (await sbx.files.exists("tree/g.txt")), "remove");
});

await check("files: watchDir sees a file written after the watch started", async () => {
  await sbx.files.makeDir("watched");
  const events = [];
  const h = await sbx.files.watchDir("watched", (ev) => events.push(ev));
  try {
    await sbx.files.write("watched/new.txt", "new");
    await waitFor("an event for new.txt", async () => events.some((e) => e.name === "new.txt"), 10_000);
  } finally {
    await h.stop();
  }
});

await check("pause, connect: a counting process goes on and a Python process keeps its value", async () => {
  const m = await Sandbox.create("base", { timeoutMs: 300_000 });
  try {
    // Each count goes to a new file renamed over the old one: a read never
    // sees the file between the shell's truncation and its write.
    const counter = await m.commands.run('i=0; while :; do i=$((i+1)); echo "$$ $i" > /tmp/count.new; mv -f /tmp/count.new /tmp/count; sleep 0.05; done', { background: true });
    // [pid of the counting shell, its count]
    const readCount = async (s) => (await s.files.read("/tmp/count")).trim().split(" ").map(Number);
    let py = "";
    const holder = await m.commands.run(`python3 -u -c 'import random, sys
v = random.getrandbits(62)
for _ in sys.stdin: print("value", v)'`, { background: true, stdin: true, onStdout: (d) => (py += d) });
    await m.commands.sendStdin(holder.pid, "\n");
    await waitFor("the Python value", async () => /value \d+\n/.test(py), 10_000);
    const value = py.match(/value (\d+)/)[1];
    await sleep(300);
    const [pid, before] = await readCount(m);
    assert(before > 1, `count before the pause ${before}`);
    // The open streams (the two background commands) do not hold the pause.
    const t0 = Date.now();
    assert((await m.pause()) === true, "pause did not return true");
    const took = Date.now() - t0;
    assert(took < 8_000, `pause with two background commands took ${took} ms`);
    assert((await Sandbox.getInfo(m.sandboxId)).state === "paused", "not paused");
    const c = await Sandbox.connect(m.sandboxId);
    const [pid2, after] = await readCount(c);
    // The same shell, not restarted (from 1): on from where it was (it ran
    // until the checkpoint).
    assert(pid2 === pid && after >= before && after < before + 200, `shell ${pid} count ${before} before the pause, shell ${pid2} count ${after} after the connect`);
    await sleep(300);
    const [, later] = await readCount(c);
    assert(later > after, `count stopped at ${after} (${later} later)`);
    assert((await c.commands.list()).some((p) => p.pid === counter.pid), "the counter is not listed after the connect");
    let py2 = "";
    await c.commands.connect(holder.pid, { onStdout: (d) => (py2 += d) });
    await c.commands.sendStdin(holder.pid, "\n");
    await waitFor("the Python value after the connect", async () => /value \d+\n/.test(py2), 10_000);
    assert(py2.match(/value (\d+)/)[1] === value, `value ${value} before the pause, ${py2} after`);
  } finally {
    await m.kill();
  }
});

await check("/dev/shm is writable by user, also after pause and connect", async () => {
  const m = await Sandbox.create("base");
  try {
    const r = await m.commands.run("stat -c %a /dev/shm; touch /dev/shm/x; python3 -c 'import multiprocessing as m; print(m.Lock().acquire())'");
    assert(r.stdout === "1777\nTrue\n", `as user: ${JSON.stringify(r.stdout)}`);
    assert((await m.pause()) === true, "pause did not return true");
    const c = await Sandbox.connect(m.sandboxId);
    const again = await c.commands.run("touch /dev/shm/y; ls /dev/shm");
    assert(again.stdout === "x\ny\n", `after the connect: ${JSON.stringify(again.stdout)}`);
  } finally {
    await m.kill();
  }
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

await check("isRunning: true running, false paused (not woken) and killed; calls to a killed sandbox say so", async () => {
  const s = await Sandbox.create("base");
  assert((await s.isRunning()) === true, "isRunning of a running sandbox is not true");
  assert((await s.pause()) === true, "pause did not return true");
  assert((await s.isRunning()) === false, "isRunning of a paused sandbox is not false");
  assert((await Sandbox.getInfo(s.sandboxId)).state === "paused", "isRunning woke the paused sandbox");
  assert((await s.kill()) === true, "kill did not return true");
  assert((await s.isRunning()) === false, "isRunning of a killed sandbox is not false");
  const e = await s.files.read("/etc/hostname").then(() => null, (err) => err);
  assert(e && e.name !== "FileNotFoundError", `files.read on a killed sandbox: ${e && e.name}: ${e && e.message}`);
});

await check("envd calls to a paused (no autoResume) or killed sandbox: the SDK's error classes, with the reason", async () => {
  const s = await Sandbox.create("base");
  const bg = await s.commands.run("sleep 600", { background: true });
  const caught = (p) => p.then(() => null, (e) => e);
  const describe = (e) => (e ? `${e.constructor.name}: ${e.message}` : "no error");
  assert((await s.pause()) === true, "pause did not return true");
  // Paused: a SandboxError (not a NotFoundError, not false) naming autoResume.
  for (const [what, p] of [["commands.run", caught(s.commands.run("true"))], ["files.list", caught(s.files.list("/"))],
    ["files.exists", caught(s.files.exists("/etc"))], ["commands.kill", caught(s.commands.kill(bg.pid))]]) {
    const e = await p;
    assert(e instanceof sdk.SandboxError && !(e instanceof sdk.NotFoundError) && e.message.includes("autoResume"), `${what} on a paused sandbox: ${describe(e)}`);
  }
  assert((await Sandbox.getInfo(s.sandboxId)).state === "paused", "the refused calls woke the sandbox");
  assert((await s.kill()) === true, "kill did not return true");
  // Killed: commands raise SandboxNotFoundError; other calls the SDK's
  // not-running TimeoutError, with the server's message; none answers false.
  const run = await caught(s.commands.run("true"));
  assert(run instanceof sdk.SandboxNotFoundError, `commands.run on a killed sandbox: ${describe(run)}`);
  for (const [what, p] of [["files.list", caught(s.files.list("/"))], ["files.exists", caught(s.files.exists("/etc"))], ["commands.kill", caught(s.commands.kill(bg.pid))]]) {
    const e = await p;
    assert(e instanceof sdk.TimeoutError && e.message.includes(s.sandboxId), `${what} on a killed sandbox: ${describe(e)}`);
  }
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

await check("with autoResume, pause() holding a background command stays paused; isRunning() wakes nothing", async () => {
  const s = await Sandbox.create("base", { lifecycle: { onTimeout: "pause", autoResume: true } });
  try {
    await s.commands.run("sleep 1000", { background: true, timeoutMs: 0 });
    // The pause cuts the command's stream; the SDK then probes GET /health,
    // which must not resume the sandbox it was asked to pause.
    assert((await s.pause()) === true, "pause did not return true");
    await sleep(1_500);
    assert((await Sandbox.getInfo(s.sandboxId)).state === "paused", "the sandbox is running again after pause()");
    assert((await s.isRunning()) === false, "isRunning() of a paused sandbox was not false");
    assert((await Sandbox.getInfo(s.sandboxId)).state === "paused", "isRunning() woke the sandbox");
  } finally {
    await s.kill();
  }
});

await check("network allowPublicTraffic false: trafficAccessToken; getHost(port) needs it, also paused (not woken without it)", async () => {
  const s = await Sandbox.create("base", { network: { allowPublicTraffic: false }, lifecycle: { onTimeout: "pause", autoResume: true } });
  try {
    const tok = s.trafficAccessToken;
    assert(typeof tok === "string" && tok.length === 64, `trafficAccessToken ${tok}`);
    await s.commands.run("mkdir -p /tmp/www && echo private > /tmp/www/index.html && cd /tmp/www && python3 -m http.server 8000", { background: true });
    const host = s.getHost(8000);
    const withToken = { "e2b-traffic-access-token": tok };
    await waitFor("the http.server", async () => (await get(host, "/", withToken)).status === 200, 30_000);
    const ok = await get(host, "/", withToken);
    assert(ok.body === "private\n", `with the token: ${ok.status} ${ok.body}`);
    const refusedWith = async (when, headers, word) => {
      const r = await get(host, "/", headers);
      let body = {};
      try {
        body = JSON.parse(r.body);
      } catch {}
      assert(r.status === 403 && body.code === 403 && body.sandboxId === s.sandboxId && body.message.includes(word), `${when}: ${r.status} ${r.body}`);
    };
    await refusedWith("no token", {}, "missing");
    await refusedWith("a wrong token", { "e2b-traffic-access-token": "0".repeat(64) }, "invalid");
    // envd (commands, files) needs no traffic token.
    assert((await s.files.read("/tmp/www/index.html")) === "private\n", "files.read");
    assert((await s.pause()) === true, "pause did not return true");
    await refusedWith("paused, no token", {}, "missing");
    assert((await Sandbox.getInfo(s.sandboxId)).state === "paused", "a refused request woke the sandbox");
    const woken = await get(host, "/", withToken);
    assert(woken.status === 200 && woken.body === "private\n", `paused, with the token: ${woken.status} ${woken.body}`);
    assert((await Sandbox.getInfo(s.sandboxId)).state === "running", "the request with the token did not wake it");
    const c = await Sandbox.connect(s.sandboxId);
    assert(c.trafficAccessToken === tok, `connect: trafficAccessToken ${c.trafficAccessToken}, want the create's`);
    await refusedWith("after the resume, no token", {}, "missing");
  } finally {
    await s.kill();
  }
  const pub = await Sandbox.create("base");
  assert(pub.trafficAccessToken === undefined, `a public sandbox has trafficAccessToken ${pub.trafficAccessToken}`);
  await pub.kill();
});

console.log(JSON.stringify({ checks }));
