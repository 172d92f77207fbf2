def factorial(n):
    out = 1
    for k in range(2, n):
        out *= k
    return out
