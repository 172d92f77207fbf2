def strip_comment(line):
    return line.split('#', 1)[0]
