"""A slot disk between tenants: wiped the way its lease says, proven, and judged fit for the next one.

``wipepolicy.py`` resolves and runs a handover's wipe policy over the two mechanisms: the block
layer's (``blockwipe.py``: discard, signatures, zero-out, read back) and the controller's own
Format NVM / Sanitize (``nvmewipe.py``, gated on what ``nvmecaps.py`` reads from the device).
``smart.py`` judges a drive's health for the quarantine re-check. Writing an image onto the disk
is the image room's clone.
"""
