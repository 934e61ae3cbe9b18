package cr

import "os"

// removeImage deletes the image directory of c, if any.
func (e *Engine) removeImage(c *ckpt) {
	e.mu.Lock()
	dir := c.image.ImageDir
	c.image = Parts{}
	e.mu.Unlock()
	if dir != "" {
		if err := os.RemoveAll(dir); err != nil {
			e.log.Warn("remove image", "dir", dir, "err", err)
		}
	}
}
