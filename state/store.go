package state

import (
	"encoding/json"
	"fmt"
	"time"

	bolt "go.etcd.io/bbolt"
)

var (
	bucketSandboxes   = []byte("sandboxes")
	bucketCheckpoints = []byte("checkpoints")
	bucketPins        = []byte("pins")
	bucketMeta        = []byte("meta")
	keyBootID         = []byte("boot_id")
)

// store persists sandboxes, checkpoints and pins in bbolt. Every write is
// one transaction, fsynced before it returns, so a crash leaves either the
// old or the new record, never a torn one.
type store struct {
	db *bolt.DB
}

func openStore(path string, noSync bool) (*store, error) {
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 5 * time.Second, NoSync: noSync})
	if err != nil {
		return nil, fmt.Errorf("open state db %s: %w", path, err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketSandboxes, bucketCheckpoints, bucketPins, bucketMeta} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("init state db %s: %w", path, err)
	}
	return &store{db: db}, nil
}

func (s *store) close() error { return s.db.Close() }

type loaded struct {
	sandboxes   []*Sandbox
	checkpoints []*Checkpoint
	pins        []string
	bootID      string
}

func (s *store) load() (*loaded, error) {
	var l loaded
	err := s.db.View(func(tx *bolt.Tx) error {
		if err := tx.Bucket(bucketSandboxes).ForEach(func(k, v []byte) error {
			var sb Sandbox
			if err := json.Unmarshal(v, &sb); err != nil {
				return fmt.Errorf("sandbox %s: %w", k, err)
			}
			l.sandboxes = append(l.sandboxes, &sb)
			return nil
		}); err != nil {
			return err
		}
		if err := tx.Bucket(bucketCheckpoints).ForEach(func(k, v []byte) error {
			var c Checkpoint
			if err := json.Unmarshal(v, &c); err != nil {
				return fmt.Errorf("checkpoint %s: %w", k, err)
			}
			l.checkpoints = append(l.checkpoints, &c)
			return nil
		}); err != nil {
			return err
		}
		if err := tx.Bucket(bucketPins).ForEach(func(k, _ []byte) error {
			l.pins = append(l.pins, string(k))
			return nil
		}); err != nil {
			return err
		}
		l.bootID = string(tx.Bucket(bucketMeta).Get(keyBootID))
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("load state db: %w", err)
	}
	return &l, nil
}

// batch is one atomic set of changes.
type batch struct {
	putSandboxes   []*Sandbox
	delSandboxes   []string
	putCheckpoints []*Checkpoint
	delCheckpoints []string
	pin, unpin     []string
	bootID         string
}

func (s *store) apply(b *batch) error {
	err := s.db.Update(func(tx *bolt.Tx) error {
		sbs := tx.Bucket(bucketSandboxes)
		for _, sb := range b.putSandboxes {
			v, err := json.Marshal(sb)
			if err != nil {
				return err
			}
			if err := sbs.Put([]byte(sb.ID), v); err != nil {
				return err
			}
		}
		for _, id := range b.delSandboxes {
			if err := sbs.Delete([]byte(id)); err != nil {
				return err
			}
		}
		cks := tx.Bucket(bucketCheckpoints)
		for _, c := range b.putCheckpoints {
			v, err := json.Marshal(c)
			if err != nil {
				return err
			}
			if err := cks.Put([]byte(c.ID), v); err != nil {
				return err
			}
		}
		for _, id := range b.delCheckpoints {
			if err := cks.Delete([]byte(id)); err != nil {
				return err
			}
		}
		pins := tx.Bucket(bucketPins)
		for _, id := range b.pin {
			if err := pins.Put([]byte(id), nil); err != nil {
				return err
			}
		}
		for _, id := range b.unpin {
			if err := pins.Delete([]byte(id)); err != nil {
				return err
			}
		}
		if b.bootID != "" {
			if err := tx.Bucket(bucketMeta).Put(keyBootID, []byte(b.bootID)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("write state db: %w", err)
	}
	return nil
}
