package state

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
