package state

import "time"

// CrashForTest closes only the metadata store, leaving sandboxes "running"
// in it, as a kill -9 of the daemon would.
func (m *Manager) CrashForTest() {
	m.wg.Wait()
	m.mu.Lock()
	m.closed = true
	m.mu.Unlock()
	m.st.close()
}

// StoreSandboxForTest writes rec as its sandbox's stored record, as a crash
// that lost the later writes would leave the store (after the background
// writes so far).
func (m *Manager) StoreSandboxForTest(rec *Sandbox) error {
	m.wg.Wait()
	return m.persist(func(b *batch) { b.putSandboxes = append(b.putSandboxes, rec) })
}

// SetWarmDeferForTest sets how long preparations wait after a fork for its
// children's first requests (warmDefer).
func (m *Manager) SetWarmDeferForTest(d time.Duration) {
	m.mu.Lock()
	m.warm.deferFor = d
	m.mu.Unlock()
}

// AwaitingForTest returns how many fork children have not finished a first
// request while preparations wait for them.
func (m *Manager) AwaitingForTest() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.warm.awaiting)
}

// SetHoldMaxForTest sets how long TurnRequest.Hold can delay a checkpoint.
func (m *Manager) SetHoldMaxForTest(d time.Duration) { m.holdMax = d }
