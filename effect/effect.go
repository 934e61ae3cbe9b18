// Package effect defines the EffectReport: what one agent turn did to a
// sandbox's operating-system state. Probes (package probe) produce reports,
// policies (package policy and the WASM modules in policies/) read them, and
// the state manager records them next to the checkpoint they led to.
//
// The JSON form of Report is stable and versioned by Version: fields are only
// ever added, never renamed or re-typed, within one major version. A compact
// binary encoding of the same report, used across the WASM policy ABI, lives
// in this package too (see policy/ABI.md).
package effect

// Version is the schema version of Report written by this build.
const Version = 1

// MaxSamples bounds every sample slice in a Report, so a turn that writes
// millions of files or forks thousands of processes yields a bounded report.
const MaxSamples = 32

// Backend names the probe implementation that produced a report.
const (
	BackendEBPF      = "ebpf"
	BackendUserspace = "userspace"
)

// Report is the effect of one turn: everything observed in one sandbox
// between two turn boundaries.
type Report struct {
	// Version is the schema version (effect.Version when produced).
	Version int `json:"version"`
	// Sandbox is the id of the sandbox the report belongs to.
	Sandbox string `json:"sandbox,omitempty"`
	// Turn is the sequence number of the turn within the sandbox, from 1.
	Turn uint64 `json:"turn"`
	// Backend is BackendEBPF or BackendUserspace.
	Backend string `json:"backend"`
	// DurationUS is the wall-clock length of the turn in microseconds.
	DurationUS int64 `json:"duration_us"`
	// LostEvents counts events the probe dropped (for example a full ring
	// buffer). A report with LostEvents > 0 must never lead to a skip.
	LostEvents uint64 `json:"lost_events"`

	FS   FS   `json:"fs"`
	Proc Proc `json:"proc"`
	Mem  Mem  `json:"mem"`
	Net  Net  `json:"net"`
}

// FS holds file-system effects.
type FS struct {
	Created      uint64 `json:"created"`
	Modified     uint64 `json:"modified"`
	Deleted      uint64 `json:"deleted"`
	Renamed      uint64 `json:"renamed"`
	MetaChanged  uint64 `json:"meta_changed"`
	BytesWritten uint64 `json:"bytes_written"`
	// UpperNonEmpty reports whether the sandbox's writable upper layer holds
	// anything at turn end (i.e. there is something a checkpoint would freeze).
	UpperNonEmpty bool `json:"upper_non_empty"`
	// Samples holds at most MaxSamples changed paths, in observation order.
	Samples []PathSample `json:"samples,omitempty"`
}

// PathSample is one observed file-system change.
type PathSample struct {
	// Op is one of "create", "modify", "delete", "rename", "meta".
	Op   string `json:"op"`
	Path string `json:"path"`
}

// Proc holds process effects.
type Proc struct {
	Forked uint64 `json:"forked"`
	Execs  uint64 `json:"execs"`
	// Exited counts processes alive at turn start and gone at turn end;
	// processes born and reaped within the turn are not counted.
	Exited uint64 `json:"exited"`
	// Alive is the number of sandbox processes alive at turn end.
	Alive uint64 `json:"alive"`
	// NewLongLived counts processes born in this turn and alive at its end.
	NewLongLived uint64 `json:"new_long_lived"`
	CwdChanges   uint64 `json:"cwd_changes"`
	SignalsSent  uint64 `json:"signals_sent"`
	// ExecSamples holds at most MaxSamples exec events.
	ExecSamples []Exec `json:"exec_samples,omitempty"`
	// LongLived describes at most MaxSamples of the NewLongLived processes.
	LongLived []Exec `json:"long_lived,omitempty"`
}

// Exec describes one process by what it ran.
type Exec struct {
	PID   int    `json:"pid"`
	Comm  string `json:"comm"`
	Argv0 string `json:"argv0,omitempty"`
}

// Mem holds memory effects.
type Mem struct {
	// PagesWritten is the total number of pages written in the turn by
	// processes alive at its end.
	PagesWritten uint64 `json:"pages_written"`
	// Exact is true when PagesWritten comes from exact write tracking
	// (PAGEMAP_SCAN with userfaultfd write-protect), false for an estimate.
	Exact   bool        `json:"exact"`
	Mmaps   uint64      `json:"mmaps"`
	Munmaps uint64      `json:"munmaps"`
	Brks    uint64      `json:"brks"`
	PerProc []ProcPages `json:"per_proc,omitempty"` // at most MaxSamples
}

// ProcPages is the number of pages one process wrote in the turn.
type ProcPages struct {
	PID   int    `json:"pid"`
	Comm  string `json:"comm"`
	Pages uint64 `json:"pages"`
}

// Net holds network effects: those a restore cannot undo.
type Net struct {
	// RemoteConnects counts sockets connected to non-loopback addresses.
	RemoteConnects uint64 `json:"remote_connects"`
	// Listens counts listening sockets opened in the turn.
	Listens   uint64 `json:"listens"`
	BytesSent uint64 `json:"bytes_sent"`
	// Remotes holds at most MaxSamples "addr:port" strings.
	Remotes []string `json:"remotes,omitempty"`
}

// FSChanged reports whether the turn changed the file system.
func (r *Report) FSChanged() bool {
	f := &r.FS
	return f.Created+f.Modified+f.Deleted+f.Renamed+f.MetaChanged+f.BytesWritten > 0
}

// ProcChanged reports whether the turn changed process state: processes
// born or died, memory written by a live process, or a cwd change.
func (r *Report) ProcChanged() bool {
	p := &r.Proc
	return p.Forked+p.Execs+p.Exited+p.NewLongLived+p.CwdChanges > 0 || r.Mem.PagesWritten > 0
}

// NetChanged reports whether the turn had an effect on the network that a
// restore cannot undo.
func (r *Report) NetChanged() bool {
	return r.Net.RemoteConnects+r.Net.Listens > 0
}
