package criu

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"syscall"
	"time"

	"github.com/checkpoint-restore/go-criu/v8/rpc"
	"golang.org/x/sys/unix"
)

// A swrk is one criu process in RPC ("swrk") mode, started by the daemon
// itself inside a sandbox's namespaces and cgroups.
//
// go-criu starts criu with exec.Command(path, "swrk", fd): no argument can
// precede "swrk" (criu needs --no-default-config there, or it reads the
// sandbox's /etc/criu/default.conf), no environment of its own, and the
// child is born in the caller's namespaces and cgroups. Dumps and restores
// therefore used to go through a shell script that joined the sandbox's
// cgroups and exec'd nsenter(1), which entered the namespaces and forked
// criu: two more processes to start on every run, 11-16 ms of a 40-56 ms
// restore on this project's VM. Here a locked OS thread enters the
// namespaces (setns) and starts criu directly, with its arguments and
// environment; the sandbox's cgroups (v1 and v2) get its pid before it is
// sent the request. The request and
// its notifications follow go-criu's protocol (its rpc types).
type swrk struct {
	cmd *exec.Cmd
	sk  *os.File
	// keys are the inherited files' keys in fd order (fd 3 on).
	keys []string
	// group is set when criu leads a process group of its own (a dump's
	// does): kill then ends the whole group.
	group bool
}

// errNotify is a notification swrk.call's caller did not expect.
var errNotify = errors.New("unexpected notify")

// startSwrk starts criu for one request. files are the descriptors it
// inherits, by key: in key order from fd 3 on, and each named to criu
// under its key (InheritFd), as go-criu does. With nsPID, criu runs in
// that process's IPC, UTS, network, PID and mount namespaces, and with
// joinCgroups in its cgroups: restores join them (the restored processes
// are then born in the sandbox's freezer, pids, memory and v2 cgroups);
// dumps must not, or a later freeze of the sandbox would freeze criu in
// the middle of its work.
func (r *Runner) startSwrk(nsPID int, joinCgroups bool, files map[string]*os.File) (*swrk, error) {
	keys, extra := inOrder(files)
	fds, err := unix.Socketpair(unix.AF_LOCAL, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("criu socket: %w", err)
	}
	cln := os.NewFile(uintptr(fds[0]), "criu-swrk-client")
	srv := os.NewFile(uintptr(fds[1]), "criu-swrk-server")
	defer srv.Close()
	extra = append(extra, srv)
	srvFD := 3 + len(extra) - 1

	// The standard streams are the host's /dev/null, opened here: after
	// setns a path would resolve in the sandbox's mount namespace.
	null, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		cln.Close()
		return nil, err
	}
	defer null.Close()

	cmd := r.command("swrk", strconv.Itoa(srvFD))
	cmd.Stdin, cmd.Stdout, cmd.Stderr = null, null, null
	cmd.ExtraFiles = extra
	if !joinCgroups {
		// A dump's criu leads a process group, so that a kill reaches
		// the helpers it forks too (see kill). A restore's does not: the
		// processes it restores may take their process group from it.
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	}
	var cgs []string
	if nsPID != 0 && joinCgroups {
		if cgs, err = r.cgroupProcsFiles(nsPID, false); err != nil {
			cln.Close()
			return nil, fmt.Errorf("cgroups of %d: %w", nsPID, err)
		}
	}
	if err := startInNamespaces(nsPID, cmd); err != nil {
		cln.Close()
		return nil, fmt.Errorf("start criu: %w", err)
	}
	s := &swrk{cmd: cmd, sk: cln, keys: keys, group: !joinCgroups}
	// criu waits for its request before it makes any process: it joins
	// the sandbox's cgroups first, v1 and v2 alike (pids, freezer,
	// memory: the restored processes are born there). By pid rather than
	// CLONE_INTO_CGROUP at the fork: that needs Linux 5.7 and covers v2
	// only.
	pid := strconv.Itoa(cmd.Process.Pid)
	err = joinCgroupFiles(cgs, pid)
	if errors.Is(err, fs.ErrNotExist) {
		// A hierarchy mounted elsewhere since its mount was cached:
		// read the mounts again and join once more.
		var again []string
		if again, err = r.cgroupProcsFiles(nsPID, true); err == nil {
			err = joinCgroupFiles(again, pid)
		}
	}
	if err != nil {
		s.kill()
		return nil, err
	}
	return s, nil
}

// joinCgroupFiles writes pid into each cgroup.procs file of files.
func joinCgroupFiles(files []string, pid string) error {
	for _, f := range files {
		if err := os.WriteFile(f, []byte(pid), 0); err != nil {
			return fmt.Errorf("move criu into %s: %w", f, err)
		}
	}
	return nil
}

// inOrder returns files' keys sorted and the files in that order: criu
// inherits them as descriptors 3, 4, ...
func inOrder(files map[string]*os.File) ([]string, []*os.File) {
	keys := make([]string, 0, len(files))
	for k := range files {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	out := make([]*os.File, 0, len(keys)+1)
	for _, k := range keys {
		out = append(out, files[k])
	}
	return keys, out
}

// call sends criu the request and answers its notifications (notify gets
// the script name and pid of each; nil refuses them) until criu answers
// the request itself. ctx ending kills criu.
func (s *swrk) call(ctx context.Context, typ rpc.CriuReqType, opts *rpc.CriuOpts, notify func(script string, pid int32) error) error {
	if len(opts.GetInheritFd()) == 0 {
		for i, k := range s.keys {
			opts.InheritFd = append(opts.InheritFd, &rpc.InheritFd{Key: ptr(k), Fd: ptr(int32(3 + i))})
		}
	}
	if notify != nil {
		opts.NotifyScripts = ptr(true)
	}
	stop := context.AfterFunc(ctx, s.kill)
	defer stop()
	req := &rpc.CriuReq{Type: &typ, Opts: opts}
	buf := make([]byte, 2*4096)
	for {
		b, err := req.MarshalVT()
		if err != nil {
			return err
		}
		if _, err := s.sk.Write(b); err != nil {
			return s.failed(ctx, fmt.Errorf("send to criu: %w", err))
		}
		n, err := s.sk.Read(buf)
		if err != nil {
			return s.failed(ctx, fmt.Errorf("read from criu: %w", err))
		}
		resp := &rpc.CriuResp{}
		if err := resp.UnmarshalVT(buf[:n]); err != nil {
			return fmt.Errorf("criu answer: %w", err)
		}
		if !resp.GetSuccess() {
			return fmt.Errorf("operation failed (msg:%s err:%d)", resp.GetCrErrmsg(), resp.GetCrErrno())
		}
		rt := resp.GetType()
		if rt != rpc.CriuReqType_NOTIFY {
			if rt != typ {
				return fmt.Errorf("criu answered %s to %s", rt, typ)
			}
			return nil
		}
		if notify == nil {
			return errNotify
		}
		nt := resp.GetNotify()
		if err := notify(nt.GetScript(), nt.GetPid()); err != nil {
			return err
		}
		req = &rpc.CriuReq{Type: &rt, NotifySuccess: ptr(true)}
	}
}

// failed is err, or ctx's error when the call failed because ctx ended
// (criu was killed).
func (s *swrk) failed(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// kill ends criu at once, with the rest of its process group if it leads
// one, and shuts the socket down. A helper criu forked (kerndat's ptrace
// test child sleeps until criu kills it) outlives a criu killed with
// SIGKILL, reparented to the sandbox's init, and holds criu's end of the
// socket: without the shutdown, a call waiting for criu's answer would
// wait for ever.
func (s *swrk) kill() {
	if s.group {
		_ = unix.Kill(-s.cmd.Process.Pid, unix.SIGKILL)
	}
	_ = s.cmd.Process.Kill()
	if rc, err := s.sk.SyscallConn(); err == nil {
		// Control fails once the socket is closed: no other file's
		// descriptor is shut down by mistake.
		_ = rc.Control(func(fd uintptr) { _ = unix.Shutdown(int(fd), unix.SHUT_RDWR) })
	}
}

// close ends the session and waits for criu to exit (it does once its
// socket closes). A criu still running after killedWait is killed, and one
// that has not ended killedWait after that (blocked where even SIGKILL
// waits) is left to end with the sandbox: its exit is collected in the
// background.
func (s *swrk) close() error {
	s.sk.Close()
	done := make(chan error, 1)
	go func() { done <- s.cmd.Wait() }()
	wait := func() (error, bool) {
		select {
		case err := <-done:
			return err, true
		case <-time.After(killedWait):
			return nil, false
		}
	}
	err, ok := wait()
	if !ok {
		s.kill()
		if err, ok = wait(); !ok {
			return fmt.Errorf("criu %d did not end %s after the kill; left to end with the sandbox", s.cmd.Process.Pid, killedWait)
		}
	}
	if err != nil {
		return fmt.Errorf("criu swrk: %w", err)
	}
	return nil
}
