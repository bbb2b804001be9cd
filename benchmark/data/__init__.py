"""What preprocessing costs against just parsing the same logs."""
