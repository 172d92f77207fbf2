def parse_kv(text):
    out = {}
    for pair in text.split(','):
        if pair:
            key, _, value = pair.partition('=')
            out[key.strip()] = value.strip()
    return out
