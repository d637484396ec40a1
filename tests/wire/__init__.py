"""Tests of the wire: key names (keys), the codec, the ACL rules (acl) and the protocol of
docs/protocol.md as a client in another language meets it."""
