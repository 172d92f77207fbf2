def transpose(rows):
    return [list(col) for col in rows]
