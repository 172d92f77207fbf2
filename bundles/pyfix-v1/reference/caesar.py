def caesar(text, k):
    out = []
    for c in text:
        if c.islower():
            out.append(chr((ord(c) - 97 + k) % 26 + 97))
        else:
            out.append(c)
    return ''.join(out)
