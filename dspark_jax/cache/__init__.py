"""Paged caches: the memory plan that sizes the page pool (`plan`), and the pool's host side (`pages`)."""
