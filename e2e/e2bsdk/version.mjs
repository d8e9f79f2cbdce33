// Prints, as one JSON object, the version each pinned copy of E2B's SDK reports about
// itself (the User-Agent it sends, "e2b-js-sdk/<version>"), keyed by its package name
// here: {"e2b":"2.51.0","e2b-2.45":"2.45.0"}. A Go test runs it to prove `npm ci`
// installed what package-lock.json pins.
import * as latest from "e2b";
import * as older from "e2b-2.45";

const prefix = "e2b-js-sdk/";
function reported(sdk) {
  const agent = new sdk.ConnectionConfig({}).headers["User-Agent"];
  if (!agent?.startsWith(prefix)) throw new Error(`unexpected User-Agent ${agent}`);
  return agent.slice(prefix.length);
}

console.log(JSON.stringify({ e2b: reported(latest), "e2b-2.45": reported(older) }));
