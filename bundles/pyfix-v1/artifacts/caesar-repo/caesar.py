def caesar(text, k):
    out = []
    for c in text:
        if c.islower():
            out.append(chr(ord(c) + k))
        else:
            out.append(c)
    return ''.join(out)
