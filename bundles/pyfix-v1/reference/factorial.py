def factorial(n):
    out = 1
    for k in range(2, n + 1):
        out *= k
    return out
