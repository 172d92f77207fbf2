def running_total(xs):
    out, total = [], 0
    for x in xs[1:]:
        total += x
        out.append(total)
    return out
