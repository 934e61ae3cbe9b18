package layer

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
)

// JournalEntry is one line of a mount's journal: the stack the mount has
// after a checkpoint, a switch or a compaction. The journal is the source
// of truth for a mount's stack (a crashed mount resumes from its last
// entry) and holds checkpoint records before they are materialized as
// files under meta/checkpoints.
type JournalEntry struct {
	// Op is "checkpoint", "switch" or "compact".
	Op string `json:"op"`
	// Checkpoint is the record taken (Op checkpoint) or switched to.
	Checkpoint Checkpoint `json:"checkpoint"`
	// Upper is the writable upper layer after the operation.
	Upper string `json:"upper"`
}

// Journal is an append-only log of one mount's stack changes. An append is
// a single write(2) to an O_APPEND file: safe against a crash of the
// process as soon as it returns; Sync makes it safe against power loss.
type Journal struct {
	mu sync.Mutex
	f  *os.File
}

func (s *Store) journalPath(mountID string) string {
	return filepath.Join(s.dir, "meta", "journal", mountID+".log")
}

// OpenJournal opens (creating) the journal of mount mountID.
func (s *Store) OpenJournal(mountID string) (*Journal, error) {
	if !ValidID(mountID) {
		return nil, fmt.Errorf("open journal: invalid mount id %q", mountID)
	}
	if err := os.MkdirAll(filepath.Join(s.dir, "meta", "journal"), 0o700); err != nil {
		return nil, fmt.Errorf("open journal %s: %w", mountID, err)
	}
	f, err := os.OpenFile(s.journalPath(mountID), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open journal %s: %w", mountID, err)
	}
	return &Journal{f: f}, nil
}

// Append writes one entry.
func (j *Journal) Append(e JournalEntry) error {
	b, err := json.Marshal(e)
	if err != nil {
		return err
	}
	b = append(b, '\n')
	j.mu.Lock()
	defer j.mu.Unlock()
	if _, err := j.f.Write(b); err != nil {
		return fmt.Errorf("journal append: %w", err)
	}
	return nil
}

// Sync flushes the journal to stable storage: every entry appended before
// it started. It does not hold off Append while the fsync runs, so a
// background sync never delays the next entry.
func (j *Journal) Sync() error {
	return j.f.Sync()
}

// Close closes the journal.
func (j *Journal) Close() error { return j.f.Close() }

// JournalEntries reads the journal of mount mountID (a torn last line is
// ignored).
func (s *Store) JournalEntries(mountID string) ([]JournalEntry, error) {
	f, err := os.Open(s.journalPath(mountID))
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []JournalEntry
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	for sc.Scan() {
		var e JournalEntry
		if json.Unmarshal(sc.Bytes(), &e) == nil {
			out = append(out, e)
		}
	}
	return out, sc.Err()
}

// eachJournal calls visit with the entries of every mount's journal.
func (s *Store) eachJournal(visit func(js []JournalEntry)) error {
	ents, err := os.ReadDir(filepath.Join(s.dir, "meta", "journal"))
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		return err
	}
	for _, e := range ents {
		id, ok := strings.CutSuffix(e.Name(), ".log")
		if !ok || !ValidID(id) {
			continue
		}
		js, err := s.JournalEntries(id)
		if err != nil {
			return fmt.Errorf("journal %s: %w", id, err)
		}
		visit(js)
	}
	return nil
}

// journalCheckpoints returns the checkpoint records found in every journal.
func (s *Store) journalCheckpoints() (map[string]Checkpoint, error) {
	out := map[string]Checkpoint{}
	err := s.eachJournal(func(js []JournalEntry) {
		for _, je := range js {
			if je.Op == "checkpoint" {
				out[je.Checkpoint.ID] = je.Checkpoint
			}
		}
	})
	return out, err
}

// settledLayers returns the layers a mount's journal names (as a frozen
// layer or as the upper) in an entry that a later entry of the same
// journal superseded: layers that were part of a mount's stack, whose
// creation is over (see GC). The last entry of a journal is left out: a
// mount being created journals its new upper before its mount record
// names it, and only the layer's age protects it in between.
func (s *Store) settledLayers() (map[string]bool, error) {
	out := map[string]bool{}
	err := s.eachJournal(func(js []JournalEntry) {
		for i := 0; i+1 < len(js); i++ {
			out[js[i].Upper] = true
			for _, l := range js[i].Checkpoint.Layers {
				out[l] = true
			}
		}
	})
	if err != nil {
		return nil, fmt.Errorf("settled layers: %w", err)
	}
	return out, nil
}
