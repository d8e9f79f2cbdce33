package gvisor

import (
	"fmt"
	"slices"
	"sort"

	"github.com/torpor/torpor/engine"
	"github.com/torpor/torpor/sandboxnet"
)

// The OCI runtime spec subset runsc reads (opencontainers/runtime-spec, config.md).
type ociSpec struct {
	OCIVersion  string            `json:"ociVersion"`
	Process     ociProcess        `json:"process"`
	Root        ociRoot           `json:"root"`
	Hostname    string            `json:"hostname"`
	Mounts      []ociMount        `json:"mounts"`
	Annotations map[string]string `json:"annotations"`
	Linux       ociLinux          `json:"linux"`
}

type ociProcess struct {
	User         ociUser             `json:"user"`
	Args         []string            `json:"args"`
	Env          []string            `json:"env"`
	Cwd          string              `json:"cwd"`
	Capabilities map[string][]string `json:"capabilities"`
	Rlimits      []ociRlimit         `json:"rlimits"`
}

type ociUser struct {
	UID int `json:"uid"`
	GID int `json:"gid"`
}

type ociRlimit struct {
	Type string `json:"type"`
	Hard uint64 `json:"hard"`
	Soft uint64 `json:"soft"`
}

type ociRoot struct {
	Path     string `json:"path"`
	Readonly bool   `json:"readonly"`
}

type ociMount struct {
	Destination string   `json:"destination"`
	Type        string   `json:"type"`
	Source      string   `json:"source"`
	Options     []string `json:"options,omitempty"`
}

type ociLinux struct {
	Namespaces  []ociNamespace `json:"namespaces"`
	Resources   *ociResources  `json:"resources,omitempty"`
	CgroupsPath string         `json:"cgroupsPath,omitempty"`
}

type ociNamespace struct {
	Type string `json:"type"`
	Path string `json:"path,omitempty"`
}

type ociResources struct {
	Memory *ociMemory `json:"memory,omitempty"`
	CPU    *ociCPU    `json:"cpu,omitempty"`
	Pids   *ociPids   `json:"pids,omitempty"`
}

type ociPids struct {
	Limit int64 `json:"limit"`
}

type ociMemory struct {
	Limit int64 `json:"limit"`
}

type ociCPU struct {
	Quota  int64  `json:"quota"`
	Period uint64 `json:"period"`
}

// The capabilities Docker grants a container's root by default (moby's
// oci/caps/defaults.go), so that root inside a sandbox behaves as users expect
// (chown, apt-get, binding port 80).
var defaultCaps = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD",
	"CAP_NET_RAW", "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP",
	"CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
}

const cpuPeriodUS = 100000

func (e *Engine) ociSpec(spec engine.Spec, p sandboxnet.Pair) ociSpec {
	env := []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "LANG=C.UTF-8"}
	keys := make([]string, 0, len(spec.Env))
	for k := range spec.Env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		env = append(env, k+"="+spec.Env[k])
	}
	caps := map[string][]string{"bounding": defaultCaps, "effective": defaultCaps, "permitted": defaultCaps}
	if spec.AgentPidsExempt && spec.PidsLimit > 0 {
		// limits.go: the agent takes it out of its bounding set at once.
		agent := append(slices.Clip(defaultCaps), "CAP_SYS_RESOURCE")
		caps = map[string][]string{"bounding": agent, "effective": agent, "permitted": agent}
	}
	res := &ociResources{}
	if spec.MemoryMiB > 0 {
		res.Memory = &ociMemory{Limit: int64(spec.MemoryMiB) << 20}
	}
	rlimits := []ociRlimit{{Type: "RLIMIT_NOFILE", Hard: 65536, Soft: 65536}}
	if spec.PidsLimit > 0 {
		rlimits = append(rlimits, ociRlimit{Type: "RLIMIT_NPROC", Hard: uint64(spec.PidsLimit), Soft: uint64(spec.PidsLimit)})
		res.Pids = &ociPids{Limit: hostPidsLimit(spec.PidsLimit)}
	}
	// gVisor reads an EROFS root from these annotations (docs/decisions/gvisor-engine.md);
	// "memory" puts the writable overlay in sandbox memory, inside checkpoints.
	annotations := map[string]string{
		rootfsAnnotation:                 spec.RootFS,
		"dev.gvisor.spec.rootfs.type":    "erofs",
		"dev.gvisor.spec.rootfs.overlay": "memory",
	}
	mounts := []ociMount{
		{Destination: "/proc", Type: "proc", Source: "proc"},
		{Destination: "/dev", Type: "tmpfs", Source: "tmpfs"},
		{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
		{Destination: "/.torpor", Type: "bind", Source: spec.GuestDir, Options: []string{"rbind", "ro"}},
	}
	if spec.WritableMiB > 0 {
		annotations["dev.gvisor.spec.rootfs.options"] = fmt.Sprintf("size=%dm", spec.WritableMiB)
	}
	if spec.TmpMiB > 0 {
		mounts = append(mounts, ociMount{Destination: "/tmp", Type: "tmpfs", Source: "tmpfs",
			Options: []string{"mode=1777", fmt.Sprintf("size=%dm", spec.TmpMiB)}})
	}
	if spec.ShmMiB > 0 {
		// After /dev, on which it is mounted.
		mounts = append(mounts, ociMount{Destination: "/dev/shm", Type: "tmpfs", Source: "shm",
			Options: []string{"mode=1777", "nosuid", "nodev", fmt.Sprintf("size=%dm", spec.ShmMiB)}})
	}
	// The CPU quota is not in the spec: runsc would apply it before the sandbox
	// boots, and a restore (seccomp compilation and page loading run in parallel)
	// takes ~250 ms longer under a 1-CPU quota on these 2-core machines (measured,
	// 64 MiB: 780 vs 525 ms). launch applies it once the sandbox runs (applyCPU).
	return ociSpec{
		OCIVersion: "1.0.0",
		Process: ociProcess{
			Args:         []string{"/.torpor/torpor-agent"},
			Env:          env,
			Cwd:          "/",
			Capabilities: caps,
			Rlimits:      rlimits,
		},
		Root:        ociRoot{Path: "rootfs", Readonly: false}, // writes go to the memory overlay
		Hostname:    "sandbox",
		Mounts:      append(mounts, volumeMounts(spec.Mounts)...),
		Annotations: annotations,
		Linux: ociLinux{
			Namespaces: []ociNamespace{
				{Type: "pid"}, {Type: "network", Path: p.GuestPath()}, {Type: "ipc"}, {Type: "uts"}, {Type: "mount"},
			},
			Resources:   res,
			CgroupsPath: e.cgroupPath(spec.ID),
		},
	}
}

// volumeMounts are the Spec's host directories as OCI bind mounts. gVisor serves
// them through its gofer: writes go to the host directory (not to the sandbox's
// memory overlay), so they are not in a checkpoint, and a restore reopens them
// by path.
func volumeMounts(ms []engine.Mount) []ociMount {
	var out []ociMount
	for _, m := range ms {
		opts := []string{"rbind", "rw"}
		if m.ReadOnly {
			opts[1] = "ro"
		}
		out = append(out, ociMount{Destination: m.Destination, Type: "bind", Source: m.Source, Options: opts})
	}
	return out
}
