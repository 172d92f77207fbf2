def second_largest(xs):
    return sorted(set(xs))[-1]
