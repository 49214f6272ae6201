"""An image from its source into the cache and onto the slot disk, hashed once on the way.

``source.py`` is the allow-list every URL (and redirect) passes before anything is opened;
``httpfetch.py`` the https source on httpx (``curlstream.py``: the same through a curl child); ``cache.py`` the cache keyed by SHA-256 (fetch, verify, evict);
``clone.py`` writes a cached image onto the slot disk with ``qemu-img``; a raw image on a miss is
written while it downloads (``streamclone.py`` over the one-pass pump ``stream.py``).
"""
