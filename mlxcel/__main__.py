from mlxcel.cli import entry

entry()
