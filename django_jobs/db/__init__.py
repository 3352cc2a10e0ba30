"""What each database does differently, behind one seam: the only package that tests a
connection's vendor."""
