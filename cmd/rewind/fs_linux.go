package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/rewind-sandbox/rewind/fs"
	"github.com/rewind-sandbox/rewind/kernelpath"
	"github.com/rewind-sandbox/rewind/layer"
)

// fsMountDetached re-executes rewind with --foreground in a new session and
// returns once its control socket answers (the mount is then ready).
func fsMountDetached(cmd *cobra.Command, o fsMountOpts, mountpoint string) error {
	st, err := layer.OpenStore(o.state)
	if err != nil {
		return fmt.Errorf("fs mount: %w", err)
	}
	if !layer.ValidID(o.id) {
		return fmt.Errorf("fs mount: invalid --id %q", o.id)
	}
	logPath := filepath.Join(st.Dir(), "ctl", o.id+".log")
	logf, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("fs mount: %w", err)
	}
	defer logf.Close()
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("fs mount: %w", err)
	}
	args := []string{"fs", "mount", "--foreground", "--state", st.Dir(), "--backend", o.backend, "--id", o.id}
	for _, l := range o.lowers {
		args = append(args, "--lower", l)
	}
	if o.from != "" {
		args = append(args, "--from", o.from)
	}
	if o.debug {
		args = append(args, "--debug")
	}
	args = append(args, mountpoint)
	c := exec.Command(self, args...)
	c.Stdout, c.Stderr = logf, logf
	c.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := c.Start(); err != nil {
		return fmt.Errorf("fs mount: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- c.Wait() }()
	deadline := time.After(60 * time.Second)
	for {
		if resp, err := fsCall(mountpoint, fsRequest{Op: "status"}); err == nil && resp.Mount == o.id {
			fmt.Fprintln(cmd.OutOrStdout(), mountpoint)
			return nil
		}
		select {
		case <-exited:
			b, _ := os.ReadFile(logPath)
			return fmt.Errorf("fs mount: server exited: %s", lastLine(b))
		case <-deadline:
			_ = c.Process.Kill()
			return fmt.Errorf("fs mount: %s not ready after 60s (log: %s)", mountpoint, logPath)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// fsServe mounts and serves the control socket until umount or a signal.
func fsServe(cmd *cobra.Command, o fsMountOpts, mountpoint string) error {
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	st, err := layer.OpenStore(o.state)
	if err != nil {
		return fmt.Errorf("fs mount: %w", err)
	}
	var v layer.FS
	var wait func()
	switch o.backend {
	case "kernel":
		k, err := kernelpath.Mount(st, mountpoint, kernelpath.Options{MountID: o.id, From: o.from, Lowers: o.lowers, Logger: log})
		if err != nil {
			return fmt.Errorf("fs mount: %w", err)
		}
		v = k
	default:
		f, err := fs.Mount(st, mountpoint, fs.Options{MountID: o.id, From: o.from, Lowers: o.lowers, Debug: o.debug, Logger: log})
		if err != nil {
			return fmt.Errorf("fs mount: %w", err)
		}
		v, wait = f, f.Wait
	}
	sock := st.ControlSocket(o.id)
	_ = os.Remove(sock)
	ln, err := net.Listen("unix", sock)
	if err != nil {
		_ = v.Unmount()
		return fmt.Errorf("fs mount: control socket: %w", err)
	}
	_ = os.Chmod(sock, 0o600)
	link, err := fsLinkFor(mountpoint)
	if err == nil {
		if err = os.MkdirAll(fsRunDir, 0o700); err == nil {
			_ = os.Remove(link)
			err = os.Symlink(sock, link)
		}
	}
	if err != nil {
		ln.Close()
		_ = v.Unmount()
		return fmt.Errorf("fs mount: control link: %w", err)
	}
	done := make(chan struct{})
	stop := func() {
		select {
		case <-done:
		default:
			close(done)
		}
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	go func() {
		select {
		case <-sigs:
			stop()
		case <-done:
		}
	}()
	if wait != nil {
		// The FUSE server may also end by an external umount.
		go func() { wait(); stop() }()
	}
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go fsHandle(conn, st, v, stop)
		}
	}()
	<-done
	ln.Close()
	// The link goes once the view is unmounted: fs umount waits for
	// that, and a mount that is still busy must not look unmounted.
	err = v.Unmount()
	_ = os.Remove(link)
	_ = os.Remove(sock)
	if err != nil {
		return fmt.Errorf("fs umount: %w", err)
	}
	return nil
}

func fsHandle(conn net.Conn, st *layer.Store, v layer.FS, stop func()) {
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Minute))
	var req fsRequest
	if err := json.NewDecoder(conn).Decode(&req); err != nil {
		return
	}
	var resp fsResponse
	t0 := time.Now()
	var err error
	switch req.Op {
	case "status":
		resp.Mount = v.MountID()
	case "checkpoint":
		resp.ID, err = v.Checkpoint()
		resp.ElapsedUS = time.Since(t0).Microseconds()
	case "restore":
		err = v.Switch(req.ID)
		resp.ElapsedUS = time.Since(t0).Microseconds()
		resp.ID = req.ID
	case "compact":
		err = v.Compact()
		resp.ElapsedUS = time.Since(t0).Microseconds()
		if f, ok := v.(*fs.FS); ok {
			resp.Depth = f.Depth()
		}
	case "ls":
		var cps []layer.Checkpoint
		cps, err = st.Checkpoints()
		base := ""
		if f, ok := v.(*fs.FS); ok {
			base = f.Base()
		}
		for _, c := range cps {
			if c.Mount != v.MountID() {
				continue
			}
			resp.Checkpoints = append(resp.Checkpoints, fsCheckpoint{ID: c.ID, Parent: c.Parent, Created: c.Created, Layers: len(c.Layers), Current: c.ID == base})
		}
	case "umount":
		defer stop()
	default:
		err = errors.New("unknown request " + req.Op)
	}
	if err != nil {
		resp.Error = err.Error()
	}
	_ = json.NewEncoder(conn).Encode(resp)
}
