def merge(base, override):
    out = dict(override)
    out.update(base)
    return out
