"""Hot-swap: the versioned weight store, announcements, swap and rollback (see issue 3)."""
