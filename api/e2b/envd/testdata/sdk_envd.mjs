// Drives E2B's SDK against envd at E2B_SANDBOX_URL (after a create at E2B_API_URL) and
// prints, as one JSON object, what the SDK made of each answer. Arguments: the
// absolute path of the SDK's dist/index.mjs, a directory to run a command in, and a
// file to stat. Run by sdk_test.go, whose stand-in envd records what the SDK sent.
import { pathToFileURL } from "node:url";

const [moduleFile, dir, file] = process.argv.slice(2);
const { Sandbox } = await import(pathToFileURL(moduleFile).href);
const out = {};
const sbx = await Sandbox.create();
out.sandboxId = sbx.sandboxId;

const r = await sbx.commands.run('echo "$GREETING from $(pwd)"; echo oops >&2', { cwd: dir, envs: { GREETING: "hi" } });
out.run = { stdout: r.stdout, stderr: r.stderr, exitCode: r.exitCode };
try {
  await sbx.commands.run("exit 3");
  out.failed = { name: "no error" };
} catch (e) {
  out.failed = { name: e.constructor.name, exitCode: e.exitCode };
}
await sbx.commands.run("true", { user: "root" });

const bg = await sbx.commands.run("sleep 30", { background: true });
out.background = { pid: bg.pid };
out.list = (await sbx.commands.list()).map((p) => ({ pid: p.pid, cmd: p.cmd, args: p.args }));
out.kill = await sbx.commands.kill(bg.pid);
try {
  await bg.wait();
  out.killedEnd = { name: "no error" };
} catch (e) {
  out.killedEnd = { name: e.constructor.name, exitCode: e.exitCode, error: e.error };
}
out.killAgain = await sbx.commands.kill(bg.pid);

const info = await sbx.files.getInfo(file);
out.info = { ...info, modifiedTime: info.modifiedTime?.toISOString() };
out.exists = await sbx.files.exists(file);
out.existsMissing = await sbx.files.exists(file + ".missing");
try {
  await sbx.files.getInfo(file + ".missing");
  out.infoMissing = "no error";
} catch (e) {
  out.infoMissing = e.constructor.name;
}
await sbx.kill();
console.log(JSON.stringify(out));
