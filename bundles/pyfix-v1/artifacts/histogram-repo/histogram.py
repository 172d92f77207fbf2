def histogram(xs):
    counts = {}
    for x in xs:
        counts[x] = counts.get(x, 1) + 1
    return counts
