package probe

// procInfo is what a snapshot records about one sandbox process.
type procInfo struct {
	PID       int
	PPID      int
	Comm      string
	Argv0     string
	StartTime uint64 // clock ticks since boot: (PID, StartTime) identifies a process
	MinFlt    uint64
	RunNS     uint64 // CPU time of all threads, from schedstat
	// Slices counts how often the threads were scheduled in (schedstat's
	// third field). It grows as soon as a thread starts running, unlike
	// RunNS, which lags for a thread still on a CPU.
	Slices  uint64
	Cwd     string
	Sockets map[uint64]struct{} // socket inodes held by the process's fds
	NetNS   string
}

// sockInfo is one socket from /proc/PID/net/{tcp,tcp6,udp,udp6}.
type sockInfo struct {
	Listen bool
	Remote string // "addr:port" of a non-loopback peer, "" otherwise
}

// snapshot is the state of a sandbox's processes at one instant.
type snapshot struct {
	Procs map[int]*procInfo
	// Socks maps socket inodes held by sandbox processes to their state.
	Socks map[uint64]sockInfo
}
