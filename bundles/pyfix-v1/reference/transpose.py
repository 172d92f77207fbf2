def transpose(rows):
    return [list(col) for col in zip(*rows)]
