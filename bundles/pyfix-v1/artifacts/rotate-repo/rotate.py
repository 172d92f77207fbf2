def rotate(xs, k):
    if not xs:
        return []
    return xs[-k:] + xs[:-k] if k else list(xs)
