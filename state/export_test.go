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
