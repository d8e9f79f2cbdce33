// Drives E2B's SDK against torpor's guest agent behind a stand-in front
// (E2B_API_URL and E2B_SANDBOX_URL) and prints, as one JSON object, what the SDK
// made of each answer. Arguments: the SDK's dist/index.mjs and a scratch
// directory. Run by envd_sdk_test.go. Every call names root: the test host has no
// "user" account.
import { pathToFileURL } from "node:url";

const [moduleFile, dir] = process.argv.slice(2);
const { Sandbox } = await import(pathToFileURL(moduleFile).href);
const user = "root";
// The SDK runs commands with "bash -l": HOME is a scratch directory so that the
// test host's login profile (root's) is not read.
const envs = { HOME: dir };
const out = {};
// Each step is named on stderr, which the test prints when the script fails.
const step = (name) => console.error(new Date().toISOString(), name);
const sbx = await Sandbox.create();

step('const r = await sbx.commands.run(\'echo "$GREETING from $(pwd');
const r = await sbx.commands.run('echo "$GREETING from $(pwd)"; echo oops >&2', { cwd: dir, envs: { ...envs, GREETING: "hi" }, user });
out.run = { stdout: r.stdout, stderr: r.stderr, exitCode: r.exitCode };
try {
  await sbx.commands.run("exit 3", { envs, user });
  out.failed = { name: "no error" };
} catch (e) {
  out.failed = { name: e.constructor.name, exitCode: e.exitCode };
  if (!(e.exitCode === 3)) out.failedMessage = String(e.message);
}

step('const bg = await sbx.commands.run("sleep 30", { background: ');
const bg = await sbx.commands.run("sleep 30", { background: true, envs, user });
step('out.list = (await sbx.commands.list()).filter((p) => p.pid =');
out.list = (await sbx.commands.list()).filter((p) => p.pid === bg.pid).map((p) => ({ cmd: p.cmd, args: p.args }));
step('out.kill = await sbx.commands.kill(bg.pid);');
out.kill = await sbx.commands.kill(bg.pid);
try {
  await bg.wait();
  out.killedEnd = { name: "no error" };
} catch (e) {
  out.killedEnd = { name: e.constructor.name, exitCode: e.exitCode, error: e.error };
}
step('out.killAgain = await sbx.commands.kill(bg.pid);');
out.killAgain = await sbx.commands.kill(bg.pid);

step('const cat = await sbx.commands.run("cat", { background: true');
const cat = await sbx.commands.run("cat", { background: true, stdin: true, envs, user });
step('await sbx.commands.sendStdin(cat.pid, "piped\\n");');
await sbx.commands.sendStdin(cat.pid, "piped\n");
step('await sbx.commands.closeStdin(cat.pid);');
await sbx.commands.closeStdin(cat.pid);
out.stdin = (await cat.wait()).stdout;

step('const w = await sbx.files.write(dir + "/sub/hello.txt", "hel');
const w = await sbx.files.write(dir + "/sub/hello.txt", "hello from the sdk", { user });
out.written = { path: w.path, name: w.name };
step('out.read = await sbx.files.read(dir + "/sub/hello.txt", { us');
out.read = await sbx.files.read(dir + "/sub/hello.txt", { user });
step('out.made = await sbx.files.makeDir(dir + "/made", { user });');
out.made = await sbx.files.makeDir(dir + "/made", { user });
step('out.madeAgain = await sbx.files.makeDir(dir + "/made", { use');
out.madeAgain = await sbx.files.makeDir(dir + "/made", { user });
step('out.list2 = (await sbx.files.list(dir, { user, depth: 2 })).');
out.list2 = (await sbx.files.list(dir, { user, depth: 2 })).map((e) => e.path.slice(dir.length + 1) + ":" + e.type).sort();
step('out.exists = await sbx.files.exists(dir + "/sub/hello.txt", ');
out.exists = await sbx.files.exists(dir + "/sub/hello.txt", { user });
step('out.existsMissing = await sbx.files.exists(dir + "/nope", { ');
out.existsMissing = await sbx.files.exists(dir + "/nope", { user });
try {
  await sbx.files.read(dir + "/nope", { user });
  out.readMissing = "no error";
} catch (e) {
  out.readMissing = e.constructor.name;
}

step('let ptyOut = "";');
let ptyOut = "";
const decoder = new TextDecoder();
step('const term = await sbx.pty.create({ cols: 90, rows: 20, user');
const term = await sbx.pty.create({ cols: 90, rows: 20, envs, user, onData: (d) => { ptyOut += decoder.decode(d); } });
step('await sbx.pty.sendInput(term.pid, new TextEncoder().encode("');
await sbx.pty.sendInput(term.pid, new TextEncoder().encode("stty size; exit\n"));
await term.wait().catch(() => {});
out.pty = ptyOut.includes("20 90");

await sbx.kill();
console.log(JSON.stringify(out));
