"""The storage tier below the host pool: KV pages kept by content-addressed keys in a backend (a directory, Mooncake's
store), so that any server process of the same model and layout finds a prefix's pages by its tokens.

`keys.py` names pages, `page_format.py` lays one out in bytes with a checksum, `base.py` is the backend interface,
`file.py` and `mooncake.py` the backends, `registry.py` picks one by name.
"""
