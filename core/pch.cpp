// Compiles the precompiled header once; every weft target reuses it.
