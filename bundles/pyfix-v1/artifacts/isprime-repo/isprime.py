def is_prime(n):
    if n < 2:
        return False
    k = 2
    while k * k < n:
        if n % k == 0:
            return False
        k += 1
    return True
