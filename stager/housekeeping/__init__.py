"""The node's housekeeping around what the mirror staged: what is on the disk, what may go, and how.

    audit     free space against what the manifest needs; Nagios exit codes, a Prometheus textfile
    reclaim   the hub scan for prune: what is unneeded, what it would free, what is in use -> Plan
    prune     removes a Plan's items, journaled, through a trash on the hub's own mount
    in_use    who holds a file right now: descriptors, maps, cwd/root, mounts in every namespace
    fence     where the node's paths end: a root's own filesystem and mount, for scans and removals
    archive   old Engram shards moved away with SHA-256 proof on both sides
    binds     the container's mounts: staged files first, the NAS read-only for what is excluded
"""
