"""Paged caches: the memory plan that sizes the page pool (`plan`), the pool's host side (`pages`), and the
prefix store of the dense slot layout (`prefix`)."""
