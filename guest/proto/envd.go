package proto

import "strings"

// E2B's envd, as the agent serves it (since Version3).
//
// E2B's SDKs talk to a daemon inside each sandbox, envd, on port 49983 (Port):
// the Connect services process.Process and filesystem.Filesystem (paths
// "/process.Process/<Method>" and "/filesystem.Filesystem/<Method>", defined in
// api/e2b/envd/proto) and three plain HTTP routes, GET /health, GET and POST
// /files and GET /envs. torpor's agent serves all of them on its own listener,
// beside torpor's protocol. The Connect paths do not clash with torpor's; the
// plain routes do (torpor's agent answers GET /health and GET/PUT /files
// itself), so the agent serves envd's plain routes under EnvdPrefix and the host
// rewrites the path of every request it forwards for envd with EnvdPath.
const (
	// EnvdMinVersion is the first protocol version that serves envd. A host
	// must not forward an envd request to an older agent (a sandbox resumed
	// from a snapshot taken before envd existed): agentclient.Client.Envd
	// names the error.
	EnvdMinVersion = Version3

	// EnvdPrefix is the path prefix of envd's plain HTTP routes on the agent.
	EnvdPrefix = "/envd"

	// PathEnvdHealth answers 204 (envd's GET /health).
	PathEnvdHealth = EnvdPrefix + "/health"
	// PathEnvdFiles is envd's /files: GET ?path=&username= answers the file's
	// bytes; POST ?path=&username= writes one (application/octet-stream) or
	// several (multipart/form-data, field "file") and answers
	// [{"path","name","type":"file"}]. Errors are {"code":<status>,"message"}.
	PathEnvdFiles = EnvdPrefix + "/files"
	// PathEnvdEnvs answers the sandbox's environment as a JSON object (envd's
	// GET /envs).
	PathEnvdEnvs = EnvdPrefix + "/envs"

	// EnvdDefaultUser is the user envd runs commands as and resolves relative
	// paths for when a request names none (envd 0.4.0 and later).
	EnvdDefaultUser = "user"
)

// envdPlain maps envd's plain HTTP paths to the agent's.
var envdPlain = map[string]string{
	"/health": PathEnvdHealth,
	"/files":  PathEnvdFiles,
	"/envs":   PathEnvdEnvs,
}

// Path prefixes of envd's Connect services.
const (
	EnvdProcessPrefix    = "/process.Process/"
	EnvdFilesystemPrefix = "/filesystem.Filesystem/"
)

// EnvdPath is the rewrite rule a host applies to the URL path of every request
// it forwards to a sandbox's envd (port 49983 in E2B's routing):
//
//   - envd's plain routes move under EnvdPrefix: "/health" → "/envd/health",
//     "/files" → "/envd/files", "/envs" → "/envd/envs";
//   - the Connect services keep their path ("/process.Process/Start",
//     "/filesystem.Filesystem/Stat", …);
//   - every other path is put under EnvdPrefix too ("/exec" → "/envd/exec"),
//     where the agent answers 404: torpor's own routes (exec as root, the
//     resume contract) are never reachable through envd.
//
// The query string is not part of p and is forwarded as it is.
func EnvdPath(p string) string {
	if q, ok := envdPlain[p]; ok {
		return q
	}
	if strings.HasPrefix(p, EnvdProcessPrefix) || strings.HasPrefix(p, EnvdFilesystemPrefix) {
		return p
	}
	return EnvdPrefix + p
}
