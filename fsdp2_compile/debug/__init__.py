"""How what the compiler recorded is drawn: the dump folder, compact graph views."""
