// Drives E2B's SDK against a control plane at E2B_API_URL and prints, as one JSON
// object, what the SDK made of each answer. Argument: the absolute path of the SDK's
// dist/index.mjs (e2e/e2bsdk/node_modules/<package>/dist/index.mjs). Run by
// sdk_test.go, whose stand-in server records what the SDK sent.
import { pathToFileURL } from "node:url";

const { Sandbox } = await import(pathToFileURL(process.argv[2]).href);
const out = {};
const errName = async (fn) => {
  try {
    await fn();
    return "no error";
  } catch (e) {
    return e.constructor.name;
  }
};

// create: every option torpor maps, then the defaults.
const sbx = await Sandbox.create("tmpl", {
  metadata: { user: "abc" },
  envs: { A: "1" },
  timeoutMs: 60_000,
  lifecycle: { onTimeout: "pause", autoResume: true },
});
out.created = { sandboxId: sbx.sandboxId, host: sbx.getHost(8080) };
const plain = await Sandbox.create();
out.createdPlain = { sandboxId: plain.sandboxId };
await Sandbox.create({ lifecycle: { onTimeout: { action: "pause", keepMemory: false } }, allowInternetAccess: false });

const info = await Sandbox.getInfo(sbx.sandboxId);
out.info = { ...info, startedAt: info.startedAt.toISOString(), endAt: info.endAt.toISOString() };
out.infoMissing = await errName(() => Sandbox.getInfo("missing"));

const pages = Sandbox.list({ query: { metadata: { "my key": "a&b=c", user: "abc" }, state: ["running", "paused"] }, limit: 2 });
out.list = [];
while (pages.hasNext) {
  const items = await pages.nextItems();
  out.list.push(items.map((s) => ({ sandboxId: s.sandboxId, state: s.state, metadata: s.metadata, cpuCount: s.cpuCount, memoryMB: s.memoryMB, startedAt: s.startedAt.toISOString() })));
}

await Sandbox.setTimeout(sbx.sandboxId, 90_000);
out.pause = await Sandbox.pause(sbx.sandboxId);
out.pauseAgain = await Sandbox.pause(sbx.sandboxId);
await Sandbox.pause(sbx.sandboxId, { keepMemory: false }).catch(() => {});
const again = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 120_000 });
out.connected = { sandboxId: again.sandboxId };
await Sandbox.connect(sbx.sandboxId);

out.snapshot = await Sandbox.createSnapshot(sbx.sandboxId, { name: "snap" });
const forks = await Sandbox.fork(sbx.sandboxId, { count: 2 });
out.forks = forks.map((f) => (f instanceof Error ? { error: f.constructor.name } : { sandboxId: f.sandboxId }));
await Sandbox.fork(sbx.sandboxId);

const metrics = await Sandbox.getMetrics(sbx.sandboxId);
out.metrics = metrics.map((m) => ({ ...m, timestamp: m.timestamp.toISOString() }));

out.kill = await Sandbox.kill(sbx.sandboxId);
out.killMissing = await Sandbox.kill("missing");
console.log(JSON.stringify(out));
