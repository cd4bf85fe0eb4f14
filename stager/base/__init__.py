"""The foundations every other part stands on; nothing here imports from above.

    errors        the exit codes and the three error kinds (BadInput 2, CannotRun 3, problems 1)
    atomic        the one way a file is written: temp beside it, fsync, rename, fsync the directory
    identity      "is it the same file": (st_dev, st_ino), mount ids, who holds a descriptor
    lock          one writer per hub or Engram directory (flock), and who holds it
    small_files   reading refs, manifests and headers without following links or blocking on FIFOs
    units         sizes, counts and durations as people write them, and back
    hints         the `repair:` commands a report ends with
    text          names made safe to print
    workers       bounded thread pools that stop at the first failure
    progress_pipe a command's byte counts for the process that runs it (stage fleet's tasks)
"""
